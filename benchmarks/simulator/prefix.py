"""Cache-aware placement vs least-loaded: SLO attainment against rate on a shared-prefix
workload, and the rate each keeps 80 % of requests within the SLO.

The paper's accelerators and model (Llama-2-13B on A100-40GB, tensor parallel 2, K/V over
NVLink), scaled out to several prefill and decode workers so that placement has a choice.
The workload is documents (or system prompts) asked about: 32 prefixes of 2,048 tokens, a
question of 32-256 tokens each, 64 tokens out at most. A worker's pool (~3,350 blocks of
16 tokens) holds about 26 of them beside nothing else: placed least-loaded, every prefill
worker meets all 32 and its LRU keeps evicting them; placed by cache, each keeps its own
share. Every worker caches in the three variants but the last:

- `cache-aware`: the P/D scheduler places each batch by cache (`PDScheduler`'s score),
- `least-loaded`: the same caches, placement blind to them (the most room, the idle one),
- `no-cache`: no prefix caching at all, for reference.

A prefill worker takes two batches at once, as the service's does
(`max_batches_per_prefill`), so placement can choose a busy worker that holds a batch's
prefixes over an idle one that does not.

SLO (assumed, chat-like): TTFT <= 1 s, TPOT <= 0.1 s. A run sends `duration_s` seconds of
arrivals and drains.
"""

from __future__ import annotations

import dataclasses

from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.metrics import SloConfig
from benchmarks.simulator.report import rate_at, table
from benchmarks.simulator.systems import SystemConfig, simulate
from benchmarks.simulator.workload import PrefixWorkloadConfig, make_prefix_workload

PREFIX_CLUSTER = ClusterConfig(
    model="llama-2-13b",
    hardware="a100-40gb",
    link="nvlink3",
    num_prefill=4,
    num_decode=8,
    tp=2,
)
PREFIX_WORKLOAD = PrefixWorkloadConfig(num_prefixes=32, prefix_len=2048, max_tokens=64)
SLO = SloConfig(1.0, 0.1)
RATES = (10.0, 20.0, 30.0, 40.0, 45.0, 50.0, 55.0, 60.0, 70.0, 80.0)
SLOTS = 2  # batches a prefill worker takes at once, as the service's default
VARIANTS = {
    "cache-aware": SystemConfig(
        prefix_caching=True, cache_aware=True, max_batches_per_prefill=SLOTS
    ),
    "least-loaded": SystemConfig(prefix_caching=True, max_batches_per_prefill=SLOTS),
    "no-cache": SystemConfig(max_batches_per_prefill=SLOTS),
}


def run_prefix(
    cluster: ClusterConfig = PREFIX_CLUSTER,
    workload: PrefixWorkloadConfig = PREFIX_WORKLOAD,
    rates: tuple[float, ...] = RATES,
    duration_s: float = 60.0,
    variants: dict[str, SystemConfig] = VARIANTS,
) -> dict:
    rows = []
    for rate in rates:
        n = max(20, int(rate * duration_s))
        requests = make_prefix_workload(dataclasses.replace(workload, num_requests=n, rate=rate))
        for label, system in variants.items():
            summary = simulate("bucketserve", cluster, requests, system).summary(SLO)
            prompt = summary["real_tokens"] + summary["cached_tokens"]
            summary["prefill_hit_rate"] = summary["cached_tokens"] / max(1, prompt)
            rows.append({"rate": rate, **summary, "system": label})
    at_80 = {
        label: rate_at(
            [r["rate"] for r in rows if r["system"] == label],
            [r["slo_attainment"] for r in rows if r["system"] == label],
        )
        for label in variants
    }
    base = at_80.get("least-loaded")
    return {
        "cluster": dataclasses.asdict(cluster),
        "workload": dataclasses.asdict(workload),
        "slo": dataclasses.asdict(SLO),
        "duration_s": duration_s,
        "rows": rows,
        "rate_at_80": at_80,
        "cache_aware_over_least_loaded": at_80["cache-aware"] / base if base else float("inf"),
    }


def prefix_table(result: dict) -> str:
    w, slo = result["workload"], result["slo"]
    title = (
        f"Shared prefixes ({w['num_prefixes']} x {w['prefix_len']} tokens, zipf {w['zipf']}; "
        f"SLO: TTFT <= {slo['ttft_s']} s, TPOT <= {slo['tpot_s']} s)"
    )
    rows = [
        (
            r["rate"],
            r["system"],
            r["slo_attainment"],
            r["server_rps"],
            r["prefill_hit_rate"],
            r["ttft_s"]["p50"],
            r["ttft_s"]["p90"],
            r["tpot_s"]["p50"],
            r["tpot_s"]["p90"],
        )
        for r in result["rows"]
    ]
    columns = (
        "rate", "system", "SLO att", "server rps", "hit rate",
        "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90",
    )  # fmt: skip
    at_80 = [(label, rate) for label, rate in result["rate_at_80"].items()]
    at_80.append(("cache-aware / least-loaded", result["cache_aware_over_least_loaded"]))
    return "\n".join(
        [table(title, columns, rows), table("Rate at 80 % SLO", ("system", "req/s"), at_80)]
    )
