"""The unified strategy's buckets `(query, shared blocks, unique blocks, is_causal)`: one
set for every step of an engine, prompt chunks and decode rows together (the bucketing
doc's alpha version), and the need of a step they pad."""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Sequence

from bucketserve.bucket_manager.bucket_range import alpha_range
from bucketserve.bucket_manager.config import ShapeBucketConfig

UnifiedBucket = tuple[int, int, int, int]  # (query, shared_blocks, unique_blocks, is_causal)


def unified_ranges(cfg: ShapeBucketConfig) -> tuple[list[int], list[int], list[int]]:
    """The points of each dimension: query tokens at the whole, half and quarter of
    max_num_seqs and of max_num_batched_tokens; shared blocks of max_num_seqs and of a
    batch of max_model_len rows (at most the pool); unique blocks of max_num_seqs and of
    the pool; both block dimensions with 0."""
    seqs = cfg.max_num_seqs
    full_batch = cfg.max_model_len // cfg.block_size * seqs
    return (
        alpha_range(seqs, cfg.max_num_batched_tokens),
        alpha_range(seqs, min(full_batch, cfg.num_blocks), zero=True),
        alpha_range(seqs, cfg.num_blocks, zero=True),
    )


def generate_unified(cfg: ShapeBucketConfig) -> list[UnifiedBucket]:
    """Every combination of the points that a step can have, both causal flags.

    A causal step (a prompt chunk in it) has at most min(max_num_seqs, query) rows, and its
    shared blocks spread over them leave each within max_model_len. A step without one
    has one token a row, so at most max_num_seqs tokens, and some context; each of its
    shared blocks is read by two tokens at least, so by at most query // 2 rows, each within
    max_model_len."""
    query, shared, unique = unified_ranges(cfg)
    seqs, block, longest = cfg.max_num_seqs, cfg.block_size, cfg.max_model_len
    buckets = []
    for q, s, u in itertools.product(query, shared, unique):
        if s * block // min(seqs, q) <= longest:
            buckets.append((q, s, u, 1))
        pairs = q // 2
        decode_only = q <= seqs and (s > 0 or u > 0)
        if decode_only and (s == 0 or (pairs > 0 and s * block // pairs <= longest)):
            buckets.append((q, s, u, 0))
    return sorted(buckets)


def unified_need(
    block_tables: Sequence[Sequence[int]],
    num_computed: Sequence[int],
    num_new_tokens: Sequence[int],
    block_size: int,
) -> UnifiedBucket:
    """A step's `(query, shared, unique, is_causal)`: its new tokens; the context blocks
    (those holding a row's tokens before this step) that two or more of its tokens read (a
    prompt chunk's, or a block several rows' tables hold: a cached prefix) and those one
    token reads (a decode row's own); causal when a row computes more than one token."""
    readers: Counter[int] = Counter()
    for table, start, n in zip(block_tables, num_computed, num_new_tokens, strict=True):
        for block in table[: -(-start // block_size)]:
            readers[block] += n
    shared = sum(1 for count in readers.values() if count > 1)
    causal = int(any(n > 1 for n in num_new_tokens))
    return (sum(num_new_tokens), shared, len(readers) - shared, causal)


class UnifiedFit:
    """The smallest bucket that holds a step: at least its query, shared and unique blocks,
    and causal if it is (a step without a prompt chunk may take a causal bucket when no
    other holds it: that graph attends decode rows too). Smallest is the per-dimension
    smallest fit where that is a bucket, else the first holder in bucket order."""

    def __init__(self, buckets: list[UnifiedBucket]) -> None:
        self._members = set(buckets)
        self._ordered = sorted(buckets)
        self._dims = [sorted({b[i] for b in buckets}) for i in range(3)]

    def find(self, need: UnifiedBucket) -> UnifiedBucket | None:
        for causal in (0, 1) if need[3] == 0 else (1,):
            fit = self._grid_fit(need, causal)
            if fit is not None:
                return fit
            for bucket in self._ordered:
                if bucket[3] == causal and all(
                    h >= w for h, w in zip(bucket[:3], need[:3], strict=True)
                ):
                    return bucket
        return None

    def _grid_fit(self, need: UnifiedBucket, causal: int) -> UnifiedBucket | None:
        fit = []
        for values, want in zip(self._dims, need[:3], strict=True):
            i = bisect.bisect_left(values, want)
            if i == len(values):
                return None
            fit.append(values[i])
        bucket = (*fit, causal)
        return bucket if bucket in self._members else None
