"""Every ``TANDEM_*`` environment variable that the engine reads, read here and nowhere else."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where fetched and converted models live (``TANDEM_CACHE_DIR``, default ~/.cache/tandem)."""
    configured = os.environ.get("TANDEM_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "tandem"


def native_kernels_disabled() -> bool:
    """``TANDEM_DISABLE_NATIVE_KERNELS=1`` keeps the CPU path on plain torch ops."""
    return os.environ.get("TANDEM_DISABLE_NATIVE_KERNELS") == "1"


def kernel_build_timeout_s() -> float:
    """How long a process waits for another to finish building or loading a native kernel
    (``TANDEM_KERNEL_BUILD_TIMEOUT_S``, default 900) before it uses the torch ops instead."""
    return float(os.environ.get("TANDEM_KERNEL_BUILD_TIMEOUT_S", "900"))


def exact_blocks_disabled() -> bool:
    """``TANDEM_EXACT_BLOCKS=0`` keeps float32 weights that are exact 4/8-bit blocks as float32
    (engine/kernels/block_linear.py), for comparisons."""
    return os.environ.get("TANDEM_EXACT_BLOCKS") == "0"


def step_log_path() -> str | None:
    """``TANDEM_STEP_LOG=PATH``: every engine in this process writes a JSON line per step and per
    prompt the prefill lane finished to PATH (``{pid}`` in it: the process id), to see where a
    served step's time goes (engine/step_log.py; `tandem bench steps LOG` summarises it). Unset: no log."""
    return os.environ.get("TANDEM_STEP_LOG") or None


def onednn_mid_pack_disabled() -> bool:
    """``TANDEM_ONEDNN_MID_PACK=0`` serves every bfloat16 product above the native kernel's rows
    with the weight packed for one row (engine/models/linear.py), for comparisons."""
    return os.environ.get("TANDEM_ONEDNN_MID_PACK") == "0"


def kv_runs_disabled() -> bool:
    """``TANDEM_KV_RUNS=0`` hands out KV blocks as before they were kept in runs: no blocks held
    ahead for a table's growth, none taken next to the one before it out of LRU order
    (engine/kv_cache/manager.py, block_pool.py), for comparisons."""
    return os.environ.get("TANDEM_KV_RUNS") == "0"
