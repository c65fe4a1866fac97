"""Bucket manager overhead and padding waste (torch-free, CPU only).

1. Lookup: a request's bucket by bisection vs the paper's linear scan, over
   the buckets Algorithm 1 itself builds on the mixed workload (k = 1 ... 64).
2. Pipeline: assign + adjust + batch formation for `--requests` requests
   (default 100,000), capped at k buckets, in microseconds per request; the
   same run with the linear scan is the baseline of the ratio.
3. Padding waste on three synthetic prompt-length distributions (fixed seed):
   - short  (Alpaca-like): lognormal, median 60, sigma 0.8 -> mean ~83 tokens;
   - long   (LongBench-like): lognormal, median 5,000, sigma 1.0, truncated to
     the model length (LongBench's own median, 41k, would put ~90 % of prompts
     at the cap, so the median is scaled down to keep the tail visible);
   - mixed: 70 % short, 30 % long;
   for: no bucketing (FCFS, padded to each batch's longest prompt), fixed
   exponential shape buckets only, adaptive buckets (Algorithm 1), and
   adaptive buckets split on shape edges. Model length 8192 (SmolLM2), block
   128, exponential shapes bs [1, 2, 64, 7] x query [128, 128, 8192, 13].

Requests arrive in waves; after each, batches form until the backlog is back
to `--backlog`, then the queue drains. Medians over `--rounds`.

    python -m benchmarks.bucketing_overhead [--requests 100000] [--rounds 5] [--out ...]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bucketserve.bucket_manager import (
    AdaptiveBuckets,
    BatchingConfig,
    BucketManager,
    BucketManagerConfig,
    BucketRange,
    BucketRequest,
    Policy,
    PromptShapeConfig,
    RequestBucketConfig,
    ShapeBucketConfig,
)

MAX_LEN = 8192
QUERY_LIMITS = {8192: 13, 6000: 14}  # exponential query buckets per model length
BLOCK_SIZE = 128
FREE_BLOCKS = 4096  # decode pool room: 0.9 x 4096 blocks of 128 tokens
MAX_TOKENS = 128
K_VALUES = (1, 4, 16, 64)
WAVE = 64
STRATEGIES = ("none", "shapes only", "adaptive", "adaptive+edges")


def short_len(rng: random.Random) -> int:
    return int(rng.lognormvariate(4.1, 0.8))


def long_len(rng: random.Random) -> int:
    return int(rng.lognormvariate(8.517, 1.0))  # median e^8.517 = 5,000


DISTRIBUTIONS: dict[str, Callable[[random.Random], int]] = {
    "short": short_len,
    "long": long_len,
    "mixed": lambda rng: short_len(rng) if rng.random() < 0.7 else long_len(rng),
}


def make_requests(dist: str, n: int, seed: int, max_len: int = MAX_LEN) -> list[BucketRequest]:
    rng = random.Random(seed)
    draw = DISTRIBUTIONS[dist]
    return [
        BucketRequest(i, min(max_len - 1, max(1, draw(rng))), MAX_TOKENS, arrival_time=i / WAVE)
        for i in range(n)
    ]


def make_manager(
    max_buckets: int, snap: float, lookup: str = "bisect", max_len: int = MAX_LEN
) -> BucketManager:
    shapes = ShapeBucketConfig(
        block_size=BLOCK_SIZE,
        max_model_len=max_len,
        prompt=PromptShapeConfig(
            bs=BucketRange(1, 2, 64, 7),
            query=BucketRange(128, 128, max_len, QUERY_LIMITS[max_len]),
        ),
    )
    requests = RequestBucketConfig(max_len=max_len, max_buckets=max_buckets, shape_edge_snap=snap)
    config = BucketManagerConfig(
        request_buckets=requests,
        shape_buckets=shapes,
        batching=BatchingConfig(max_num_seqs=64, max_batched_tokens=None),
    )
    manager = BucketManager(config)
    if lookup == "linear":
        manager.buckets.find = functools.partial(linear_find, manager.buckets)
    return manager


def linear_find(table: AdaptiveBuckets, length: int) -> Any:
    """The paper's O(k) scan (Algorithm 1, lines 3-8), the baseline of the bisection."""
    for bucket in table.buckets:
        if bucket.low <= length < bucket.up:
            return bucket
    table.check_length(length)
    raise AssertionError("buckets do not cover [0, max_len)")


@dataclass
class Run:
    seconds: float
    batches: list
    max_buckets_seen: int


def run_pipeline(manager: BucketManager, requests: list[BucketRequest], backlog: int) -> Run:
    batches, most = [], 1
    start = time.perf_counter()
    for first in range(0, len(requests), WAVE):
        for request in requests[first : first + WAVE]:
            manager.add(request)
        now = requests[first].arrival_time
        while len(manager) > backlog:
            batches.append(manager.next_batch(FREE_BLOCKS, BLOCK_SIZE, now))
            most = max(most, len(manager.buckets.buckets))
    while len(manager):
        batches.append(manager.next_batch(FREE_BLOCKS, BLOCK_SIZE, now))
    return Run(time.perf_counter() - start, batches, most)


def bench_lookup(requests: list[BucketRequest], rounds: int) -> list[dict]:
    """ns per lookup over the buckets Algorithm 1 builds with at most k of them."""
    rows = []
    lengths = [r.prompt_len for r in requests[:20_000]]
    for k in (1, 2, 4, 8, 16, 32, 64):
        table = AdaptiveBuckets(RequestBucketConfig(max_len=MAX_LEN, max_buckets=k))
        for seq, request in enumerate(requests[:20_000]):
            table.push(Policy.FCFS.order_key(request, seq), request)
        while table.adjust(n_max=16) > 0:
            pass
        timings = {}
        linear = functools.partial(linear_find, table)
        for name, find in (("bisect", table.find), ("linear", linear)):
            samples = []
            for _ in range(rounds):
                start = time.perf_counter()
                for length in lengths:
                    find(length)
                samples.append((time.perf_counter() - start) / len(lengths) * 1e9)
            timings[name] = statistics.median(samples)
        k_real = len(table.buckets)
        rows.append({"k": k_real, "bisect_ns": timings["bisect"], "linear_ns": timings["linear"]})
    return rows


def bench_pipeline(requests: list[BucketRequest], rounds: int, backlog: int) -> list[dict]:
    rows = []
    for k in K_VALUES:
        per = {"bisect": [], "linear": []}
        seen = 0
        for _ in range(rounds):
            for lookup in ("bisect", "linear"):  # interleaved: both see the same machine noise
                run = run_pipeline(make_manager(k, 0.125, lookup), requests, backlog)
                per[lookup].append(run.seconds / len(requests) * 1e6)
                seen = max(seen, run.max_buckets_seen)
        bisect_us, linear_us = statistics.median(per["bisect"]), statistics.median(per["linear"])
        rows.append(
            {
                "k_cap": k,
                "k_reached": seen,
                "bisect_us_per_request": bisect_us,
                "linear_us_per_request": linear_us,
                "linear_over_bisect": linear_us / bisect_us,
                "rounds_us": per,
            }
        )
    return rows


def waste_stats(batches: list, strategy: str) -> dict:
    real = sum(b.prompt_tokens for b in batches)
    if strategy == "none":  # no shapes: each batch runs at its own (n, S_max)
        length_pad = sum(len(b) * b.max_prompt_len for b in batches)
        shape_pad = length_pad
        shapes = {(len(b), b.max_prompt_len) for b in batches}
        misses = len(shapes)
    else:
        length_pad = sum(len(b) * b.shape[1] for b in batches)
        shape_pad = sum(b.shape[0] * b.shape[1] for b in batches)
        misses = sum(b.graph_miss for b in batches)
    return {
        "batches": len(batches),
        "mean_batch_size": statistics.fmean(len(b) for b in batches),
        "eq2_waste_ratio": statistics.fmean(b.waste_ratio for b in batches),
        "length_padding": 1 - real / length_pad,
        "shape_padding": 1 - real / shape_pad,
        "graph_misses": misses,
    }


def bench_waste(n: int, seeds: int, backlog: int, max_len: int) -> dict:
    settings = {"none": (1, 0.0), "shapes only": (1, 0.0), "adaptive": (64, 0.0)}
    settings["adaptive+edges"] = (64, 0.125)
    out = {}
    for dist in DISTRIBUTIONS:
        out[dist] = {}
        for strategy in STRATEGIES:
            per_seed = []
            for seed in range(seeds):
                requests = make_requests(dist, n, seed, max_len)
                manager = make_manager(*settings[strategy], max_len=max_len)
                batches = run_pipeline(manager, requests, backlog).batches
                per_seed.append(waste_stats(batches, strategy))
            out[dist][strategy] = {
                key: statistics.median(s[key] for s in per_seed) for key in per_seed[0]
            }
        lengths = [r.prompt_len for r in make_requests(dist, n, 0, max_len)]
        out[dist]["lengths"] = {
            "mean": statistics.fmean(lengths),
            "median": statistics.median(lengths),
            "at_model_length": sum(length == max_len - 1 for length in lengths) / n,
        }
    return out


def print_report(lookup: list[dict], pipeline: list[dict], waste: dict[int, dict]) -> None:
    print("\nBucket lookup (ns per request; Algorithm 1's own buckets on the mixed workload)")
    print(f"  {'k':>3}  {'bisect':>8}  {'linear':>8}  {'linear/bisect':>13}")
    for r in lookup:
        ratio = r["linear_ns"] / r["bisect_ns"]
        print(f"  {r['k']:>3}  {r['bisect_ns']:>8.0f}  {r['linear_ns']:>8.0f}  {ratio:>13.2f}")
    print("\nassign + adjust + batch formation (us per request, median)")
    print(f"  {'k cap':>5}  {'k reached':>9}  {'bisect':>7}  {'linear scan':>11}  {'ratio':>6}")
    for r in pipeline:
        print(
            f"  {r['k_cap']:>5}  {r['k_reached']:>9}  {r['bisect_us_per_request']:>7.2f}  "
            f"{r['linear_us_per_request']:>11.2f}  {r['linear_over_bisect']:>6.2f}"
        )
    print("\nPadding waste (median over seeds; padding = 1 - real tokens / padded tokens)")
    head = f"  {'len':>4} {'workload':<8} {'strategy':<15} {'Eq.2':>6} {'length pad':>10}"
    print(head + f" {'shape pad':>9} {'vs none':>7} {'batch':>6} {'misses':>6}")
    for max_len, table in waste.items():
        for dist in DISTRIBUTIONS:
            rows = table[dist]
            base = rows["none"]["shape_padding"]
            for strategy in STRATEGIES:
                r = rows[strategy]
                print(
                    f"  {max_len:>4} {dist:<8} {strategy:<15} {r['eq2_waste_ratio']:>6.3f} "
                    f"{r['length_padding']:>10.3f} {r['shape_padding']:>9.3f} "
                    f"{r['shape_padding'] / base:>7.2f} {r['mean_batch_size']:>6.1f} "
                    f"{r['graph_misses']:>6.0f}"
                )
    print("  misses for 'none': distinct (batch, length) shapes it would have to compile")
    for max_len, table in waste.items():
        for dist in DISTRIBUTIONS:
            lengths = table[dist]["lengths"]
            print(
                f"  {max_len} {dist}: mean {lengths['mean']:.0f}, median {lengths['median']:.0f}, "
                f"{lengths['at_model_length']:.0%} truncated to the model length"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--waste-requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--backlog", type=int, default=512, help="queue kept by the waste runs")
    parser.add_argument(
        "--pipeline-backlog", type=int, default=8192, help="queue kept by the overhead runs"
    )
    parser.add_argument("--out", default="benchmarks/results/bucketing_overhead.json")
    args = parser.parse_args()
    logging.getLogger("bucket_manager").setLevel(logging.ERROR)  # graph-miss warnings

    requests = make_requests("mixed", args.requests, seed=0)
    lookup = bench_lookup(requests, args.rounds)
    pipeline = bench_pipeline(requests, args.rounds, args.pipeline_backlog)
    waste = {
        max_len: bench_waste(args.waste_requests, args.seeds, args.backlog, max_len)
        for max_len in QUERY_LIMITS
    }
    print_report(lookup, pipeline, waste)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args), "lookup": lookup, "pipeline": pipeline, "waste": waste}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
