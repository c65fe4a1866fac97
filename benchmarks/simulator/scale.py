"""Scale: 1,000 accelerators and 10,000 requests/s. Does the central scheduler keep up?

One BucketManager and one P/D scheduler serve every prefill and decode worker (Llama-2-7B
on H100s, 400 prefill + 600 decode, K/V over one 400 Gb/s InfiniBand port per GPU, mixed
workload). The cluster is sized so that the accelerators themselves mostly keep up
(prefill ~40 req/s per H100 at this workload's ~970-token mean prompt and its long tail;
decode ~24 req/s per H100 once its pool holds prompt + max_tokens for ~65 sequences; a
prompt's ~510 MB of K/V takes ~13 ms on the port, ~51 ms on 100 GbE, which would cap 400
ports at ~8k req/s): what is left to ask is the scheduler.
Its cost is what the real calls inside the simulation (`add`, `next_batch`, the pick and
the lease) take, as this thread's CPU time and as wall clock; it keeps up when its CPU
time per simulated second of arrivals is under one second (one core). The decode workers'
own Scheduler steps run on their own hosts in the service; they are what makes the
simulation itself slow, and are not counted.
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
    link="ib-ndr-400g",
    num_prefill=400,
    num_decode=600,
    max_num_seqs=256,
)


def run_scale(
    cluster: ClusterConfig = SCALE_CLUSTER, rate: float = 10_000.0, duration_s: float = 5.0
) -> dict:
    config = WorkloadConfig("mixed", int(rate * duration_s), rate, cluster.model_spec.max_len)
    requests = make_workload(config)
    sim = build("bucketserve", cluster)
    start, cpu_start = time.perf_counter(), time.process_time()
    result = sim.run(requests)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    summary = result.summary()
    scheduler_s = summary["bucket_manager_s"] + summary["pd_scheduler_s"]
    scheduler_cpu_s = summary["bucket_manager_cpu_s"] + summary["pd_scheduler_cpu_s"]
    window = requests[-1].arrival
    n = len(requests)
    bm_us = 1e6 * summary["bucket_manager_cpu_s"] / n
    pd_us = 1e6 * summary["pd_scheduler_cpu_s"] / n
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
        "bucket_manager_cpu_s": summary["bucket_manager_cpu_s"],
        "pd_scheduler_cpu_s": summary["pd_scheduler_cpu_s"],
        "scheduler_us_per_request": bm_us + pd_us,  # the parts' sum, exactly
        "bucket_manager_us_per_request": bm_us,
        "pd_scheduler_us_per_request": pd_us,
        "scheduler_wall_us_per_request": 1e6 * scheduler_s / n,
        "scheduler_cpu_per_simulated_s": scheduler_cpu_s / window,
        "max_requests_per_s_one_core": n / scheduler_cpu_s,
        "keeps_up": scheduler_cpu_s / window < 1.0,
        "max_queued": summary["max_queued"],
        "max_buckets": summary["max_buckets"],
        "bucket_splits": summary["bucket_splits"],
        "bucket_merges": summary["bucket_merges"],
        "preemptions": summary["preemptions"],
        "simulation_wall_s": wall,
        "simulation_cpu_share": cpu / wall,
        "decode_steps": summary["decode_steps"],
        "events": summary["events"],
    }


def scale_table(result: dict) -> str:
    r, c = result, result["cluster"]
    rows = [
        (
            "accelerators (prefill + decode)",
            f"{r['accelerators']} ({r['cluster']['num_prefill']} + {r['cluster']['num_decode']})",
        ),
        ("model / accelerator / K/V link", f"{c['model']} / {c['hardware']} / {c['link']}"),
        ("offered rate (req/s)", r["rate"]),
        ("requests / arrival window (s)", f"{r['requests']} / {r['arrival_window_s']:.2f}"),
        ("finished / makespan (s)", f"{r['finished']} / {r['makespan_s']:.2f}"),
        ("TTFT p50 / p99 (s)", f"{r['ttft_s']['p50']:.3f} / {r['ttft_s']['p99']:.3f}"),
        ("TPOT p50 / p99 (s)", f"{r['tpot_s']['p50']:.4f} / {r['tpot_s']['p99']:.4f}"),
        ("mean prefill batch", r["mean_batch_size"]),
        ("most queued / request buckets reached", f"{r['max_queued']} / {r['max_buckets']}"),
        ("bucket splits / merges", f"{r['bucket_splits']} / {r['bucket_merges']}"),
        ("bucket manager CPU (us/request)", r["bucket_manager_us_per_request"]),
        ("P/D scheduler CPU (us/request)", r["pd_scheduler_us_per_request"]),
        ("scheduler wall clock (us/request)", r["scheduler_wall_us_per_request"]),
        ("scheduler CPU per simulated second", r["scheduler_cpu_per_simulated_s"]),
        ("requests/s one core could schedule", r["max_requests_per_s_one_core"]),
        ("keeps up (< 1 CPU-s per s)", r["keeps_up"]),
        ("simulation wall time (s)", r["simulation_wall_s"]),
        ("share of a core the simulation got", r["simulation_cpu_share"]),
        ("decode steps simulated", r["decode_steps"]),
    ]
    return table("Scale run", ("quantity", "value"), rows)
