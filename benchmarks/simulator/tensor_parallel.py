"""Tensor parallelism at paper scale: Llama-2-13B on A100-40GB, one worker of 1 card (tp 1)
next to one of 2 cards over NVLink 3 (tp 2, the paper's setup), as the cost model prices
them: each card computes half of every GEMM and holds half the weights, heads and K/V; two
all-reduces per layer of `tokens x hidden` fp16 cost `2 (tp - 1) / tp` of that over the
link each (ring all-reduce). For prefill and decode steps: step time, its all-reduce share,
tokens/s per worker and per card; the KV pool per worker; and the served mixed workload
with 1 prefill + 1 decode worker of each kind (rate at 80 % SLO attainment)."""

from __future__ import annotations

import dataclasses

from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.online import SLOS
from benchmarks.simulator.report import rate_at, table
from benchmarks.simulator.systems import simulate
from benchmarks.simulator.workload import WorkloadConfig, make_workload

A100 = ClusterConfig(
    model="llama-2-13b", hardware="a100-40gb", link="nvlink3", num_prefill=1, num_decode=1
)
CLUSTERS = {"tp 1": A100, "tp 2": dataclasses.replace(A100, tp=2)}
PREFILLS = ((1, 512), (8, 512))  # (prompts, tokens each)
DECODES = ((1, 1024), (32, 1024), (128, 1024))  # (rows, context tokens each)
RATES = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0)


def _step(cost, kind: str, rows: int, length: int) -> dict:
    if kind == "prefill":
        work = cost.prefill_work([length] * rows)
    else:
        work = cost.decode_work(rows, rows * length)
    parts = cost.breakdown(work)
    seconds = sum(parts.values())
    return {
        "step": f"{kind} {rows} x {length}",
        "step_s": seconds,
        "allreduce_share": parts["allreduce"] / seconds,
        "tokens_per_s": work.tokens / seconds,
        "tokens_per_s_per_card": work.tokens / seconds / cost.tp,
    }


def run_tp(duration_s: float = 60.0, seed: int = 0, dist: str = "mixed") -> dict:
    slo = SLOS[dist]
    out: dict = {"slo": dataclasses.asdict(slo), "workload": dist, "clusters": {}}
    for label, cluster in CLUSTERS.items():
        cost = cluster.cost_model()
        steps = [_step(cost, "prefill", r, n) for r, n in PREFILLS]
        steps += [_step(cost, "decode", r, n) for r, n in DECODES]
        rows = []
        for rate in RATES:
            n = max(20, int(rate * duration_s))
            requests = make_workload(
                WorkloadConfig(dist, n, rate, cluster.model_spec.max_len, seed=seed)
            )
            rows.append({"rate": rate, **simulate("bucketserve", cluster, requests).summary(slo)})
        out["clusters"][label] = {
            "cluster": dataclasses.asdict(cluster),
            "cards": cluster.num_accelerators,
            "kv_blocks_per_worker": cluster.num_kv_blocks(),
            "steps": steps,
            "rate_at_80": rate_at([r["rate"] for r in rows], [r["slo_attainment"] for r in rows]),
            "rows": rows,
        }
    return out


def tp_table(result: dict) -> str:
    one, two = result["clusters"]["tp 1"], result["clusters"]["tp 2"]
    rows = []
    for a, b in zip(one["steps"], two["steps"], strict=True):
        rows.append((
            a["step"], a["step_s"] * 1e3, b["step_s"] * 1e3, a["step_s"] / b["step_s"],
            b["allreduce_share"], a["tokens_per_s_per_card"], b["tokens_per_s_per_card"],
        ))  # fmt: skip
    columns = ("step", "tp 1 ms", "tp 2 ms", "speed-up", "tp 2 all-reduce share",
               "tp 1 tok/s/card", "tp 2 tok/s/card")  # fmt: skip
    title = "Tensor parallel 2 vs 1: Llama-2-13B on A100-40GB, NVLink 3 (cost model)"
    served = (
        f"\nKV blocks per worker: tp 1 {one['kv_blocks_per_worker']}, tp 2 "
        f"{two['kv_blocks_per_worker']}; {result['workload']} workload, 1P+1D, req/s at 80 % "
        f"SLO: tp 1 ({one['cards']} cards) {one['rate_at_80']}, tp 2 ({two['cards']} cards) "
        f"{two['rate_at_80']}"
    )
    return table(title, columns, rows) + served
