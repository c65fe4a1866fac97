"""Simulated requests: prompt lengths from the bucket manager benchmark's synthetic
distributions, output lengths from a stated lognormal, Poisson (or all-at-once) arrivals.

Output lengths (tokens, before the `max_tokens` cap): prompts under 1,024 tokens answer
like Alpaca (lognormal, median 80, sigma 0.7: mean ~100), longer ones summarize like
LongBench (median 200, sigma 0.5: mean ~230). Prompts are cut to `max_len - max_tokens`
so that prompt plus the largest answer fits the model.

The shared-prefix workload (`PrefixWorkloadConfig`) is system prompts or documents asked
about: each prompt is one of K prefixes of L tokens, uniform or Zipf over the prefixes, and
a question of its own. Its requests name their prefix, and `prompt_tokens` spells their
token ids (so block hashes, and prefix-cache hits, are what a real prompt would get).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.bucketing_overhead import DISTRIBUTIONS
from bucketserve.utils.checks import check_choice, check_int, check_number

FIRST_ID = 3  # token ids from here: below are the simulated decode's TOKEN and EOS
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
    prefix: int = -1  # the shared prefix it starts with (-1: none)
    prefix_len: int = 0


def prompt_tokens(request: SimRequest) -> list[int]:
    """The request's token ids: its prefix's (the same for every request naming it), then
    tokens of its own (prefixes take the even ids, requests the odd ones)."""
    own = FIRST_ID + 2 * request.request_id + 1
    shared = [FIRST_ID + 2 * request.prefix] * request.prefix_len if request.prefix >= 0 else []
    return shared + [own] * (request.prompt_len - len(shared))


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


@dataclass(frozen=True)
class PrefixWorkloadConfig:
    """`num_prefixes` prefixes of `prefix_len` tokens, each request's drawn uniformly
    (`zipf` 0) or with probability ~ 1 / rank^zipf, then a suffix of its own of
    `suffix_len` tokens (uniform over the inclusive range); outputs as the short workload's.
    `rate` requests/s as a Poisson process, or all at t=0 when None."""

    num_prefixes: int = 64
    prefix_len: int = 2048
    suffix_len: tuple[int, int] = (32, 256)
    zipf: float = 0.0
    num_requests: int = 1000
    rate: float | None = None
    max_len: int = 4096
    max_tokens: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("PrefixWorkloadConfig.num_prefixes", self.num_prefixes, 1)
        check_int("PrefixWorkloadConfig.prefix_len", self.prefix_len, 1)
        low, high = self.suffix_len
        check_int("PrefixWorkloadConfig.suffix_len[0]", low, 1)
        check_int("PrefixWorkloadConfig.suffix_len[1]", high, low)
        check_number("PrefixWorkloadConfig.zipf", self.zipf, 0.0)
        check_int("PrefixWorkloadConfig.num_requests", self.num_requests, 1)
        if self.rate is not None:
            check_number("PrefixWorkloadConfig.rate", self.rate, 1e-9)
        check_int("PrefixWorkloadConfig.max_tokens", self.max_tokens, 1)
        longest = self.prefix_len + high + self.max_tokens
        check_int("PrefixWorkloadConfig.max_len", self.max_len, longest)


def make_prefix_workload(config: PrefixWorkloadConfig) -> list[SimRequest]:
    rng = random.Random(config.seed)
    weights = [1.0 / (rank + 1) ** config.zipf for rank in range(config.num_prefixes)]
    now, requests = 0.0, []
    for i in range(config.num_requests):
        if config.rate is not None:
            now += rng.expovariate(config.rate)
        prefix = rng.choices(range(config.num_prefixes), weights)[0]
        prompt = config.prefix_len + rng.randint(*config.suffix_len)
        out = output_len(rng, 0, config.max_tokens)  # answers like the short workload's
        requests.append(
            SimRequest(i, prompt, out, config.max_tokens, now, prefix, config.prefix_len)
        )
    return requests
