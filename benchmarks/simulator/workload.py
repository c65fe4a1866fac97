"""Simulated requests: prompt lengths from the bucket manager benchmark's synthetic
distributions, output lengths from a stated lognormal, Poisson (or all-at-once) arrivals.

Output lengths (tokens, before the `max_tokens` cap): prompts under 1,024 tokens answer
like Alpaca (lognormal, median 80, sigma 0.7: mean ~100), longer ones summarize like
LongBench (median 200, sigma 0.5: mean ~230). Prompts are cut to `max_len - max_tokens`
so that prompt plus the largest answer fits the model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.bucketing_overhead import DISTRIBUTIONS
from bucketserve.utils.checks import check_choice, check_int, check_number

LONG_PROMPT = 1024
OUTPUT_SHORT = (4.382, 0.7)  # ln 80
OUTPUT_LONG = (5.298, 0.5)  # ln 200


@dataclass(frozen=True)
class SimRequest:
    request_id: int
    prompt_len: int
    output_len: int  # tokens it generates before its EOS (at most max_tokens)
    max_tokens: int
    arrival: float


@dataclass(frozen=True)
class WorkloadConfig:
    """`rate` requests/s as a Poisson process, or every request at t=0 when None."""

    dist: str = "mixed"
    num_requests: int = 1000
    rate: float | None = None
    max_len: int = 4096
    max_tokens: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("WorkloadConfig.dist", self.dist, tuple(DISTRIBUTIONS))
        check_int("WorkloadConfig.num_requests", self.num_requests, 1)
        if self.rate is not None:
            check_number("WorkloadConfig.rate", self.rate, 1e-9)
        check_int("WorkloadConfig.max_tokens", self.max_tokens, 1)
        check_int("WorkloadConfig.max_len", self.max_len, self.max_tokens + 2)


def output_len(rng: random.Random, prompt_len: int, cap: int) -> int:
    mu, sigma = OUTPUT_LONG if prompt_len >= LONG_PROMPT else OUTPUT_SHORT
    return max(1, min(cap, int(rng.lognormvariate(mu, sigma))))


def make_workload(config: WorkloadConfig) -> list[SimRequest]:
    rng = random.Random(config.seed)
    draw = DISTRIBUTIONS[config.dist]
    longest = config.max_len - config.max_tokens
    now, requests = 0.0, []
    for i in range(config.num_requests):
        if config.rate is not None:
            now += rng.expovariate(config.rate)
        prompt = min(longest, max(1, draw(rng)))
        out = output_len(rng, prompt, config.max_tokens)
        requests.append(SimRequest(i, prompt, out, config.max_tokens, now))
    return requests
