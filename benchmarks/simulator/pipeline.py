"""Pipeline stages at paper scale: Llama-2-13B on Gaudi2, 2 stages per worker next to 1.

Three clusters serve the mixed workload with BucketServe's scheduling: one prefill and one
decode worker of 1 stage (2 cards); the same two workers as 2-stage groups (4 cards, each
stage half the layers and their K/V, hidden states over the cards' 3 x 100 GbE); and 2 + 2
workers of 1 stage (the same 4 cards spent on more workers instead). For each: the rate at
80 % SLO attainment, the peak served rate, TTFT / TPOT p90 at one mid rate, the K/V pool
per worker, and the bubble fraction (stage time idle while a worker has work in flight).
"""

from __future__ import annotations

import dataclasses

from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.online import SLOS
from benchmarks.simulator.report import rate_at, table
from benchmarks.simulator.systems import simulate
from benchmarks.simulator.workload import WorkloadConfig, make_workload

GAUDI2 = ClusterConfig(
    model="llama-2-13b", hardware="gaudi2", link="gaudi2-roce-3x100g",
    pp_link="gaudi2-roce-3x100g", num_prefill=1, num_decode=1,
)
CLUSTERS = {
    "1 stage, 1P+1D (2 cards)": GAUDI2,
    "2 stages, 1P+1D (4 cards)": dataclasses.replace(GAUDI2, pp=2),
    "1 stage, 2P+2D (4 cards)": dataclasses.replace(GAUDI2, num_prefill=2, num_decode=2),
}
RATES = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0)
MID_RATE = 4.0


def run_pipeline(duration_s: float = 90.0, seed: int = 0, dist: str = "mixed") -> dict:
    slo = SLOS[dist]
    out: dict = {"slo": dataclasses.asdict(slo), "workload": dist, "clusters": {}}
    for label, cluster in CLUSTERS.items():
        rows = []
        for rate in RATES:
            n = max(20, int(rate * duration_s))
            requests = make_workload(
                WorkloadConfig(dist, n, rate, cluster.model_spec.max_len, seed=seed)
            )
            rows.append({"rate": rate, **simulate("bucketserve", cluster, requests).summary(slo)})
        mid = next(r for r in rows if r["rate"] == MID_RATE)
        out["clusters"][label] = {
            "cluster": dataclasses.asdict(cluster),
            "cards": cluster.num_accelerators,
            "kv_blocks_per_worker": cluster.num_kv_blocks(),
            "rate_at_80": rate_at([r["rate"] for r in rows], [r["slo_attainment"] for r in rows]),
            "peak_server_rps": max(r["server_rps"] for r in rows),
            "mid": {
                "rate": MID_RATE,
                "ttft_p90_s": mid["ttft_s"]["p90"],
                "tpot_p90_s": mid["tpot_s"]["p90"],
                "decode_bubble_fraction": mid["decode_bubble_fraction"],
                "prefill_bubble_fraction": mid["prefill_bubble_fraction"],
            },
            "rows": rows,
        }
    return out


def pipeline_table(result: dict) -> str:
    rows = [
        (
            label,
            c["cards"],
            c["kv_blocks_per_worker"],
            c["rate_at_80"],
            c["peak_server_rps"],
            c["mid"]["ttft_p90_s"],
            c["mid"]["tpot_p90_s"],
            c["mid"]["decode_bubble_fraction"],
            c["mid"]["prefill_bubble_fraction"],
        )
        for label, c in result["clusters"].items()
    ]
    columns = ("cluster", "cards", "KV blocks/worker", "req/s @80%", "peak req/s",
               f"TTFT p90 @{MID_RATE:g}", f"TPOT p90 @{MID_RATE:g}", "decode bubble",
               "prefill bubble")
    title = (f"Pipeline stages: Llama-2-13B on Gaudi2, {result['workload']} workload, "
             f"SLO TTFT <= {result['slo']['ttft_s']:g} s, TPOT <= {result['slo']['tpot_s']:g} s")
    return table(title, columns, rows)
