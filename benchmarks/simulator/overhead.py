"""Fig. 6: where a request's time goes, and what the bucket manager itself costs.

(a) BucketServe on the mixed workload at a few rates: the mean of each phase of a
request's life (queued for prefill, prefill, K/V transfer, decode) and the bucket
manager's measured CPU time per request (`add` + `next_batch`: this thread's CPU time in
the real code inside the simulation), as a share of the mean end-to-end latency.
(b) The same CPU time per request with the request buckets capped at 1 ... 64, under an
overload that makes Algorithm 1 split; the median of `repeats` identical runs (the
simulation is deterministic, the CPU time of a shared machine is not).
"""

from __future__ import annotations

import dataclasses
import statistics

from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.report import table
from benchmarks.simulator.systems import SystemConfig, simulate
from benchmarks.simulator.workload import WorkloadConfig, make_workload

PHASES = ("queue", "prefill", "transfer", "decode")


def phases(record) -> dict[str, float]:
    return {
        "queue": record.prefill_start - record.arrival,
        "prefill": record.first_token - record.prefill_start,
        "transfer": record.decode_start - record.first_token,
        "decode": record.finish - record.decode_start,
    }


def run_overhead(
    cluster: ClusterConfig,
    rates=(2.0, 4.0, 6.0),
    bucket_caps=(1, 2, 4, 8, 16, 32, 64),
    duration_s: float = 90.0,
    overload_rate: float = 12.0,
    repeats: int = 3,
) -> dict:
    max_len = cluster.model_spec.max_len
    breakdown = []
    for rate in rates:
        config = WorkloadConfig("mixed", int(rate * duration_s), rate, max_len)
        result = simulate("bucketserve", cluster, make_workload(config))
        done = result.finished
        means = {p: statistics.fmean(phases(r)[p] for r in done) for p in PHASES}
        bucketing = result.stats["bucket_manager_cpu_s"] / len(done)
        e2e = statistics.fmean(r.e2e for r in done)
        breakdown.append(
            {
                "rate": rate,
                **{f"{p}_s": v for p, v in means.items()},
                "bucketing_s": bucketing,
                "e2e_s": e2e,
                "bucketing_share_of_e2e": bucketing / e2e,
                "bucket_manager_cpu_s": result.stats["bucket_manager_cpu_s"],
                "bucket_manager_wall_s": result.stats["bucket_manager_s"],
                "bucketing_share_of_makespan": result.stats["bucket_manager_cpu_s"]
                / result.makespan,
                "max_buckets": result.stats["max_buckets"],
            }
        )
    scaling = []
    config = WorkloadConfig("mixed", int(overload_rate * duration_s), overload_rate, max_len)
    requests = make_workload(config)
    for cap in bucket_caps:
        runs = [
            simulate("bucketserve", cluster, requests, SystemConfig(max_buckets=cap))
            for _ in range(repeats)
        ]
        result = runs[0]  # the simulation is deterministic; only its CPU time varies
        cpu_us = [1e6 * r.stats["bucket_manager_cpu_s"] / len(requests) for r in runs]
        scaling.append(
            {
                "bucket_cap": cap,
                "max_buckets": result.stats["max_buckets"],
                "us_per_request": statistics.median(cpu_us),
                "us_per_request_min": min(cpu_us),
                "us_per_request_max": max(cpu_us),
                "requests_per_batch": result.stats["mean_batch_size"],
                "prefill_padding": result.stats["prefill_padding"],
                "server_rps": result.summary()["server_rps"],
            }
        )
    return {"cluster": dataclasses.asdict(cluster), "breakdown": breakdown, "scaling": scaling}


def overhead_table(result: dict) -> str:
    a = table(
        "Fig. 6a: mean seconds per request, BucketServe, mixed workload",
        (
            "rate",
            "queue",
            "prefill",
            "transfer",
            "decode",
            "bucketing",
            "e2e",
            "bucketing %",
            "buckets",
        ),
        [
            (
                r["rate"],
                r["queue_s"],
                r["prefill_s"],
                r["transfer_s"],
                r["decode_s"],
                r["bucketing_s"],
                r["e2e_s"],
                100 * r["bucketing_share_of_e2e"],
                r["max_buckets"],
            )
            for r in result["breakdown"]
        ],
    )
    b = table(
        "Fig. 6b: bucket manager CPU per request vs the bucket cap (mixed, overload)",
        (
            "cap",
            "buckets reached",
            "us/request",
            "min",
            "max",
            "requests/batch",
            "prefill padding",
            "server rps",
        ),
        [
            (
                r["bucket_cap"],
                r["max_buckets"],
                r["us_per_request"],
                r["us_per_request_min"],
                r["us_per_request_max"],
                r["requests_per_batch"],
                r["prefill_padding"],
                r["server_rps"],
            )
            for r in result["scaling"]
        ],
    )
    return a + "\n" + b
