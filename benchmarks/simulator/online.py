"""Fig. 5c-f: SLO attainment and server rate vs client rate, Poisson arrivals.

SLOs (assumed, DistServe-style per workload): short (Alpaca-like chat) TTFT <= 1 s and
TPOT <= 0.1 s; mixed (with LongBench-like prompts) TTFT <= 5 s and TPOT <= 0.15 s. A run
sends `duration_s` seconds of arrivals and drains; server rate = finished / makespan.
"""

from __future__ import annotations

import dataclasses

from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.metrics import SloConfig
from benchmarks.simulator.report import rate_at, table
from benchmarks.simulator.systems import SystemConfig, simulate
from benchmarks.simulator.workload import WorkloadConfig, make_workload

SLOS = {"short": SloConfig(1.0, 0.1), "mixed": SloConfig(5.0, 0.15)}
RATES = {
    "short": (1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 36.0, 40.0, 44.0, 46.0, 48.0, 56.0, 64.0),
    "mixed": (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 8.0),
}
# label -> (system, its config): BucketServe as designed, and with prompt-only KV accounting
VARIANTS = {
    "bucketserve": ("bucketserve", SystemConfig()),
    "bucketserve-prompt-kv": ("bucketserve", SystemConfig(count_output_tokens=False)),
    "fcfs": ("fcfs", None),
    "fcfs-varlen": ("fcfs", SystemConfig(pad="none")),
    "static": ("static", None),
}
# BucketServe over DistServe at 80 % attainment (Fig. 5c-d), and its peak server rate over
# DistServe and UELLM (Fig. 5e-f); both DistServe-like baselines stand beside DistServe
PAPER = {"short": {"fcfs": 1.37, "fcfs-varlen": 1.37}, "mixed": {"fcfs": 1.93, "fcfs-varlen": 1.93}}
PAPER_SERVER = {
    "short": {"static": 1.975},
    "mixed": {"fcfs": 1.4, "fcfs-varlen": 1.4, "static": 3.47},
}


def run_online(
    cluster: ClusterConfig,
    dists=("short", "mixed"),
    duration_s: float = 90.0,
    seed: int = 0,
    variants: dict = VARIANTS,
) -> dict:
    out = {"cluster": dataclasses.asdict(cluster), "slos": {}, "workloads": {}}
    for dist in dists:
        slo = SLOS[dist]
        out["slos"][dist] = dataclasses.asdict(slo)
        rows = []
        for rate in RATES[dist]:
            n = max(20, int(rate * duration_s))
            config = WorkloadConfig(dist, n, rate, cluster.model_spec.max_len, seed=seed)
            requests = make_workload(config)
            for label, (name, system) in variants.items():
                summary = simulate(name, cluster, requests, system).summary(slo)
                rows.append({"rate": rate, **summary, "system": label})
        out["workloads"][dist] = {"rows": rows, **_ratios(dist, rows)}
    return out


def _ratios(dist: str, rows: list[dict]) -> dict:
    at_80 = {}
    peak = {}
    for name in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == name]
        at_80[name] = rate_at([r["rate"] for r in mine], [r["slo_attainment"] for r in mine])
        peak[name] = max(r["server_rps"] for r in mine)
    ratios = {
        base: {
            "ours": at_80["bucketserve"] / at_80[base] if at_80[base] else float("inf"),
            "paper": PAPER[dist].get(base),
        }
        for base in ("fcfs", "fcfs-varlen", "static", "bucketserve-prompt-kv")
        if base in at_80
    }
    server = {
        base: {"ours": peak["bucketserve"] / peak[base], "paper": PAPER_SERVER[dist].get(base)}
        for base in ("fcfs", "fcfs-varlen", "static")
        if base in peak
    }
    return {
        "rate_at_80": at_80,
        "peak_server_rps": peak,
        "ratios_at_80": ratios,
        "peak_server_ratios": server,
    }


def online_table(result: dict) -> str:
    parts = []
    for dist, data in result["workloads"].items():
        slo = result["slos"][dist]
        rows = [
            (
                r["rate"],
                r["system"],
                r["slo_attainment"],
                r["server_rps"],
                r["goodput_rps"],
                r["ttft_s"]["p50"],
                r["ttft_s"]["p99"],
                r["tpot_s"]["p50"],
                r["tpot_s"]["p99"],
                r.get("preemptions", 0),
            )
            for r in data["rows"]
        ]
        parts.append(
            table(
                f"Online, {dist} (SLO: TTFT <= {slo['ttft_s']} s, TPOT <= {slo['tpot_s']} s)",
                (
                    "rate",
                    "system",
                    "SLO att",
                    "server rps",
                    "goodput",
                    "TTFT p50",
                    "TTFT p99",
                    "TPOT p50",
                    "TPOT p99",
                    "preempt",
                ),
                rows,
            )
        )
        ratio_rows = [
            (
                f"{dist}: rate at 80 % / {base}",
                data["rate_at_80"]["bucketserve"],
                data["rate_at_80"][base],
                v["ours"],
                v["paper"],
            )
            for base, v in data["ratios_at_80"].items()
        ] + [
            (
                f"{dist}: peak server rps / {base}",
                data["peak_server_rps"]["bucketserve"],
                data["peak_server_rps"][base],
                v["ours"],
                v["paper"],
            )
            for base, v in data["peak_server_ratios"].items()
        ]
        parts.append(
            table("Ratios", ("metric", "bucketserve", "baseline", "ratio", "paper"), ratio_rows)
        )
    return "\n".join(parts)
