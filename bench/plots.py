"""PNG plots of `tandem bench serve --sweep` and `tandem bench compare` results (matplotlib,
no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the backend)

_METRICS = (("ttft", "time to first token (ms)"), ("itl", "inter-token latency (ms)"), ("e2e", "end-to-end (ms)"))


def latency_cdfs(runs: dict[str, dict], path: str | Path, title: str = "") -> Path:
    """One panel per metric (TTFT, ITL, E2E), one CDF line per run (label -> summary with
    ``samples_ms``)."""
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for axis, (key, label) in zip(axes, _METRICS):
        for name, summary in runs.items():
            values = sorted(summary.get("samples_ms", {}).get(key) or [])
            if values:
                axis.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
        axis.set_xlabel(label)
        axis.set_ylabel("fraction of samples")
        axis.set_xscale("log")
        axis.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return _save(figure, path)


def sweep(servers: dict[str, dict[float, dict]], path: str | Path, title: str = "") -> Path:
    """Goodput and p99 ITL against request rate, one line per server (name -> rate -> summary)."""
    figure, (goodput, itl) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, by_rate in servers.items():
        rates = sorted(by_rate)
        goodput.plot(rates, [by_rate[r]["goodput"] for r in rates], marker="o", label=name)
        itl.plot(rates, [by_rate[r]["itl_ms"]["p99"] or float("nan") for r in rates], marker="o", label=name)
    goodput.set_ylabel("goodput (requests/s within the SLOs)")
    itl.set_ylabel("p99 inter-token latency (ms, log scale)")
    itl.set_yscale("log")
    for axis in (goodput, itl):
        axis.set_xlabel("request rate (requests/s)")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return _save(figure, path)


def _save(figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
