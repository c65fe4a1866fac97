"""Scale: 1,000 accelerators and 10,000 requests/s. Does the central scheduler keep up?

One BucketManager and one P/D scheduler serve every prefill and decode worker (Llama-2-7B
on H100s, K/V over one 100 GbE RoCE port each, mixed workload). Their CPU time is the wall
clock of the real calls inside the simulation (`add`, `next_batch`, the pick and the
lease); the scheduler keeps up when that time per simulated second of arrivals is under
one second. The decode workers' own Scheduler steps run on their own hosts in the
service; their total appears separately, as part of what the simulation itself costs.
"""

from __future__ import annotations

import dataclasses
import time

from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.report import table
from benchmarks.simulator.systems import build
from benchmarks.simulator.workload import WorkloadConfig, make_workload

SCALE_CLUSTER = ClusterConfig(
    model="llama-2-7b",
    hardware="h100-sxm",
    link="roce-100g",
    num_prefill=500,
    num_decode=500,
    max_num_seqs=256,
)


def run_scale(
    cluster: ClusterConfig = SCALE_CLUSTER, rate: float = 10_000.0, duration_s: float = 10.0
) -> dict:
    config = WorkloadConfig("mixed", int(rate * duration_s), rate, cluster.model_spec.max_len)
    requests = make_workload(config)
    sim = build("bucketserve", cluster)
    start = time.perf_counter()
    result = sim.run(requests)
    wall = time.perf_counter() - start
    summary = result.summary()
    scheduler_s = summary["bucket_manager_s"] + summary["pd_scheduler_s"]
    window = requests[-1].arrival
    return {
        "cluster": dataclasses.asdict(cluster),
        "accelerators": cluster.num_accelerators,
        "rate": rate,
        "requests": len(requests),
        "arrival_window_s": window,
        "makespan_s": summary["makespan_s"],
        "finished": summary["finished"],
        "server_rps": summary["server_rps"],
        "ttft_s": summary["ttft_s"],
        "tpot_s": summary["tpot_s"],
        "mean_batch_size": summary["mean_batch_size"],
        "bucket_manager_s": summary["bucket_manager_s"],
        "pd_scheduler_s": summary["pd_scheduler_s"],
        "scheduler_us_per_request": 1e6 * scheduler_s / len(requests),
        "bucket_manager_us_per_request": 1e6 * summary["bucket_manager_s"] / len(requests),
        "pd_scheduler_us_per_request": 1e6 * summary["pd_scheduler_s"] / len(requests),
        "scheduler_cpu_per_simulated_s": scheduler_s / window,
        "keeps_up": scheduler_s / window < 1.0,
        "simulation_wall_s": wall,
        "decode_steps": summary["decode_steps"],
        "events": summary["events"],
    }


def scale_table(result: dict) -> str:
    r = result
    rows = [
        (
            "accelerators (prefill + decode)",
            f"{r['accelerators']} ({r['cluster']['num_prefill']} + {r['cluster']['num_decode']})",
        ),
        ("offered rate (req/s)", r["rate"]),
        ("requests / arrival window (s)", f"{r['requests']} / {r['arrival_window_s']:.2f}"),
        ("finished / makespan (s)", f"{r['finished']} / {r['makespan_s']:.2f}"),
        ("TTFT p50 / p99 (s)", f"{r['ttft_s']['p50']:.3f} / {r['ttft_s']['p99']:.3f}"),
        ("TPOT p50 / p99 (s)", f"{r['tpot_s']['p50']:.4f} / {r['tpot_s']['p99']:.4f}"),
        ("mean prefill batch", r["mean_batch_size"]),
        ("bucket manager CPU (us/request)", r["bucket_manager_us_per_request"]),
        ("P/D scheduler CPU (us/request)", r["pd_scheduler_us_per_request"]),
        ("scheduler CPU per simulated second", r["scheduler_cpu_per_simulated_s"]),
        ("keeps up (< 1 s per s)", r["keeps_up"]),
        ("simulation wall time (s)", r["simulation_wall_s"]),
        ("decode steps simulated", r["decode_steps"]),
    ]
    return table("Scale run", ("quantity", "value"), rows)
