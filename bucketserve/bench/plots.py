"""PNG plots of a sweep: SLO attainment vs request rate, server vs client rate (Fig. 5c-f)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_sweeps(systems: dict[str, list[dict[str, Any]]], out_dir: Path, title: str) -> list[Path]:
    """`systems` maps a label to its runs (each with `rate` and `summary`); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (att, served) = plt.subplots(1, 2, figsize=(10, 4))
    top = 0.0
    for label, runs in systems.items():
        runs = [r for r in runs if r.get("rate") is not None]
        rates = [r["rate"] for r in runs]
        top = max([top, *rates])
        att.plot(rates, [100 * r["summary"]["slo_attainment"] for r in runs], "o-", label=label)
        served.plot(rates, [r["summary"]["request_throughput"] for r in runs], "o-", label=label)
    att.axhline(80, color="grey", linestyle=":", linewidth=1)
    att.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 105))
    served.plot([0, top], [0, top], color="grey", linestyle=":", linewidth=1, label="ideal")
    served.set(xlabel="client request rate (req/s)", ylabel="server completion rate (req/s)")
    for ax in (att, served):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = out_dir / "slo_attainment_and_served_rate.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]
