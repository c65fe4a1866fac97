"""Fig. 5a-b: offline throughput and accelerator utilization vs batch size.

Every request arrives at t=0 (mixed Alpaca-like + LongBench-like prompts); the batch size
caps a prefill batch and the decode running batch of every system alike. BucketServe's
tenant is offline with SJF inside buckets. `fcfs-varlen` is the DistServe-like baseline
with varlen prefill (no padding at all, as on a GPU with flash attention): the paper's
DistServe ran on vLLM, so its ratio is the fairer one to set beside the paper's 1.31x.
Medians over seeds.
"""

from __future__ import annotations

import dataclasses
import statistics

from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.report import table
from benchmarks.simulator.systems import SystemConfig, simulate
from benchmarks.simulator.workload import WorkloadConfig, make_workload

PAPER = {"static": 3.58, "fcfs": 1.31, "fcfs-varlen": 1.31}  # over UELLM, DistServe: Fig. 5a
OFFLINE = SystemConfig(offline=True)
VARIANTS = {  # label -> (system, its config)
    "bucketserve": ("bucketserve", OFFLINE),
    "fcfs": ("fcfs", OFFLINE),
    "fcfs-varlen": ("fcfs", SystemConfig(offline=True, pad="none")),
    "static": ("static", OFFLINE),
}


def run_offline(
    cluster: ClusterConfig,
    batch_sizes=(8, 16, 32, 64, 128, 256),
    num_requests: int = 600,
    seeds: int = 3,
    dist: str = "mixed",
) -> dict:
    rows = []
    for batch in batch_sizes:
        sized = dataclasses.replace(cluster, max_num_seqs=batch)
        for label, (name, system) in VARIANTS.items():
            runs = []
            for seed in range(seeds):
                workload = WorkloadConfig(
                    dist, num_requests, None, sized.model_spec.max_len, seed=seed
                )
                result = simulate(name, sized, make_workload(workload), system)
                runs.append(result.summary())
            rows.append(
                {
                    "batch_size": batch,
                    "system": label,
                    **{
                        key: statistics.median(r[key] for r in runs)
                        for key in ("output_tok_s", "total_tok_s", "server_rps", "utilization")
                    },
                    "prefill_padding": statistics.median(r["prefill_padding"] for r in runs),
                    "preemptions": statistics.median(r.get("preemptions", 0) for r in runs),
                }
            )
    top = max(batch_sizes)
    best = {r["system"]: r["output_tok_s"] for r in rows if r["batch_size"] == top}
    ratios = {
        base: {"ours": best["bucketserve"] / best[base], "paper": PAPER[base]} for base in PAPER
    }
    return {"cluster": dataclasses.asdict(cluster), "rows": rows, "ratios_at_largest": ratios}


def offline_table(result: dict) -> str:
    rows = [
        (
            r["batch_size"],
            r["system"],
            r["output_tok_s"],
            r["total_tok_s"],
            r["server_rps"],
            r["utilization"],
            r["prefill_padding"],
            r["preemptions"],
        )
        for r in result["rows"]
    ]
    text = table(
        "Offline throughput vs batch size (Fig. 5a-b), medians over seeds",
        ("batch", "system", "out tok/s", "total tok/s", "req/s", "busy", "pad", "preempt"),
        rows,
    )
    ratio_rows = [
        (f"bucketserve / {base}", v["ours"], v["paper"])
        for base, v in result["ratios_at_largest"].items()
    ]
    return (
        text
        + "\n"
        + table(
            "Output-token throughput ratio at the largest batch size",
            ("ratio", "simulated", "paper"),
            ratio_rows,
        )
    )
