"""`--mode auto`: the shape a cluster gets from what its workers would run on.

Disaggregation pays where prefill and decode workers each have compute of their own (a GPU
each, or nodes of their own): prompt arrivals then never stall a decode step. Where every
worker would share one node's CPU cores, one colocated worker with every core and
time-bounded prefill chunks has the better TTFT everywhere and the higher capacity on short
prompts; disaggregation keeps only its lower ITL and, under long prompts, a higher capacity
(docs/benchmarks.md, "Capacity with a steady load"), which a deployment asks for with
``--mode disagg``."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Mode(StrEnum):
    """``--mode``: the cluster's shape."""

    AUTO = "auto"  # resolved by choose_mode to one of the others
    DISAGG = "disagg"  # prefill and decode pools
    COLOCATED = "colocated"  # decode workers prefill too


MODES = tuple(mode.value for mode in Mode)


@dataclass(frozen=True)
class ModeChoice:
    mode: Mode  # DISAGG or COLOCATED
    reason: str  # one line for `tandem serve` to print


def worker_nodes(nodes: list[dict]) -> list[dict]:
    """The live Ray nodes that can hold a worker (``ray.nodes()`` entries): those offering the
    ``prefill`` or ``decode`` resource that worker actors ask for (the Helm chart's worker
    pods; the one node of a Ray that `tandem serve` starts)."""
    return [node for node in nodes if node.get("Alive") and {"prefill", "decode"} & set(node.get("Resources", {}))]


def choose_mode(requested: str, nodes: list[dict], cluster_gpus: float, prefill_gpus: float, decode_gpus: float,
                prefill_workers: int, decode_workers: int) -> ModeChoice:
    """``requested`` unless it is ``auto``; then disagg where the workers would not share
    compute (more than one node can hold them, or every worker gets a whole GPU of its own),
    else colocated."""
    if Mode(requested) is not Mode.AUTO:
        return ModeChoice(Mode(requested), f"--mode {requested}")
    hosts = worker_nodes(nodes)
    if len(hosts) > 1:
        return ModeChoice(Mode.DISAGG, f"auto: {len(hosts)} Ray nodes can hold workers, so prefill and decode "
                                    "workers need not share cores")
    wanted = prefill_workers * prefill_gpus + decode_workers * decode_gpus
    if prefill_gpus >= 1 and decode_gpus >= 1 and cluster_gpus >= wanted:
        return ModeChoice(Mode.DISAGG, f"auto: every worker gets a GPU of its own ({cluster_gpus:g} in the cluster)")
    where = "one GPU" if cluster_gpus and (prefill_gpus or decode_gpus) else "one node's CPU cores"
    return ModeChoice(Mode.COLOCATED, f"auto: prefill and decode workers would share {where}; one colocated "
                                   "worker prefills in time-bounded chunks beside its decoding streams")


def default_worker_threads(mode: str, nodes: list[dict], decode_workers: int) -> int:
    """Torch threads per worker when ``--worker-threads`` is not given: a colocated pool on one
    node shares that node's CPUs; disaggregated workers take one each (the Helm chart and
    multi-node deployments set their own)."""
    hosts = worker_nodes(nodes)
    if Mode(mode) is not Mode.COLOCATED or len(hosts) != 1:
        return 1
    cpus = int(hosts[0].get("Resources", {}).get("CPU", 1))
    return max(1, cpus // max(1, decode_workers))
