"""PNG figures in the paper's shapes (matplotlib, imported only when plotting)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.simulator.overhead import PHASES

LABELS = {
    "bucketserve": "BucketServe (ours)",
    "bucketserve-prompt-kv": "BucketServe, prompt-only KV",
    "fcfs": "DistServe-like FCFS",
    "fcfs-varlen": "DistServe-like FCFS, varlen prefill",
    "static": "UELLM-like static",
}
COLORS = {
    "bucketserve": "tab:blue",
    "bucketserve-prompt-kv": "tab:purple",
    "fcfs": "tab:orange",
    "fcfs-varlen": "tab:green",
    "static": "tab:red",
}
PHASE_COLORS = {  # bucketing red as in the paper; no phase shares its color
    "queue": "tab:gray",
    "prefill": "tab:blue",
    "transfer": "tab:green",
    "decode": "tab:orange",
    "bucketing": "red",
}


def _style(name: str) -> dict:
    return {"label": LABELS.get(name, name), "color": COLORS.get(name)}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    return path


def plot_offline(result: dict, out: Path) -> list[Path]:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["system"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["system"] == name]
        sizes = [r["batch_size"] for r in rows]
        axes[0].plot(sizes, [r["output_tok_s"] for r in rows], "o-", **_style(name))
        axes[1].plot(sizes, [100 * r["utilization"] for r in rows], "o-", **_style(name))
    for ax, ylabel, tag in zip(axes, ("output tokens/s", "busy time (%)"), "ab", strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max batch size")
        ax.set_ylabel(ylabel)
        ax.set_title(f"Fig. 5{tag} (simulated)")
        ax.legend(fontsize=8)
    return [_save(fig, out / "fig5ab_offline.png")]


def plot_online(result: dict, out: Path) -> list[Path]:
    plt = _pyplot()
    paths = []
    for dist, (att_tag, rps_tag) in zip(
        result["workloads"], (("c", "e"), ("d", "f")), strict=False
    ):
        rows = result["workloads"][dist]["rows"]
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        top = max(r["rate"] for r in rows)
        axes[1].plot([0, top], [0, top], "k--", label="y = x")
        for name in dict.fromkeys(r["system"] for r in rows):
            mine = [r for r in rows if r["system"] == name]
            rates = [r["rate"] for r in mine]
            axes[0].plot(rates, [100 * r["slo_attainment"] for r in mine], "o-", **_style(name))
            axes[1].plot(rates, [r["server_rps"] for r in mine], "o-", **_style(name))
        axes[0].axhline(80, color="grey", lw=0.8)
        axes[0].set_ylabel("SLO attainment (%)")
        axes[1].set_ylabel("server requests/s")
        axes[0].set_title(f"Fig. 5{att_tag}: {dist} (simulated)")
        axes[1].set_title(f"Fig. 5{rps_tag}: {dist} (simulated)")
        for ax in axes:
            ax.set_xlabel("client requests/s")
            ax.legend(fontsize=8)
        paths.append(_save(fig, out / f"fig5{att_tag}{rps_tag}_online_{dist}.png"))
    return paths


def plot_overhead(result: dict, out: Path) -> list[Path]:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    rows = result["breakdown"]
    labels = [f"{r['rate']:g} req/s" for r in rows]
    bottom = [0.0] * len(rows)
    for phase in (*PHASES, "bucketing"):
        values = [r[f"{phase}_s"] for r in rows]
        axes[0].bar(labels, values, bottom=bottom, label=phase, color=PHASE_COLORS[phase])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, (top, r) in enumerate(zip(bottom, rows, strict=True)):
        share = 100 * r["bucketing_share_of_e2e"]
        axes[0].annotate(f"bucketing {share:.4f} %", (x, top), ha="center", va="bottom", fontsize=8)
    axes[0].set_ylim(top=1.12 * max(bottom))
    axes[0].set_ylabel("mean seconds per request")
    axes[0].set_title("Fig. 6a: where the time goes (simulated)")
    axes[0].legend()
    scaling = result["scaling"]
    median = [r["us_per_request"] for r in scaling]
    spread = [
        [m - r.get("us_per_request_min", m) for m, r in zip(median, scaling, strict=True)],
        [r.get("us_per_request_max", m) - m for m, r in zip(median, scaling, strict=True)],
    ]
    axes[1].errorbar([r["max_buckets"] for r in scaling], median, yerr=spread, fmt="o-")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("request buckets reached")
    axes[1].set_ylabel("bucket manager CPU (us/request)")
    axes[1].set_title("Fig. 6b: bucketing overhead vs buckets")
    axes[1].set_ylim(bottom=0)
    return [_save(fig, out / "fig6_overhead.png")]


def plot_calibration(result: dict, out: Path) -> list[Path]:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    for kind, marker in (("prefill", "o"), ("decode", "s")):
        for held, fill in ((False, "full"), (True, "none")):
            rows = [r for r in result["rows"] if r["kind"] == kind and r["held_out"] == held]
            ax.plot(
                [r["measured_ms"] for r in rows],
                [r["predicted_ms"] for r in rows],
                marker,
                fillstyle=fill,
                ls="",
                label=f"{kind}{' (held out)' if held else ''}",
            )
    top = max(max(r["measured_ms"], r["predicted_ms"]) for r in result["rows"])
    ax.plot([0, top], [0, top], "k--", lw=0.8)
    for factor in (0.8, 1.2):
        ax.plot([0, top], [0, factor * top], ":", color="grey", lw=0.8)
    ax.text(0.97, 0.03, "dotted: +/- 20 %", transform=ax.transAxes, ha="right", color="grey")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step (ms, CPU time of one thread)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title("Cost model vs ModelRunner\nSmolLM2-135M fp32, one CPU thread")
    ax.legend()
    return [_save(fig, out / "calibration.png")]
