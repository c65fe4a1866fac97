"""Padding waste: Eq. 2 (one batch) and Eq. 3 (expected, over a length distribution)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def waste_ratio(lengths: Sequence[int]) -> float:
    """Eq. 2: (S_max - S_avg) / S_max, the share of a batch padded to its longest member."""
    if not lengths:
        raise ValueError("waste_ratio needs at least one length")
    s_max = max(lengths)
    return (s_max - sum(lengths) / len(lengths)) / s_max


def padded_waste(lengths: Sequence[int], query_len: int, batch_size: int | None = None) -> float:
    """Padding share when every sequence pads to `query_len`: Eq. 2 with S_max -> query_len.

    With `batch_size`, the padded batch rows count too (the whole padded shape).
    """
    rows = len(lengths) if batch_size is None else batch_size
    if not lengths or rows < len(lengths) or query_len < max(lengths):
        raise ValueError(f"padded shape ({rows}, {query_len}) must hold all {len(lengths)} lengths")
    return 1.0 - sum(lengths) / (rows * query_len)


def expected_waste(lengths: Sequence[int], uppers: Sequence[int]) -> float:
    """Eq. 3 over the empirical distribution of `lengths`.

    Each length S lies in the bucket whose upper bound U is the first of the
    sorted `uppers` above S, and contributes (1 - S / U) with weight 1/n.
    """
    if not lengths:
        return 0.0
    total = 0.0
    for length in lengths:
        index = bisect.bisect_right(uppers, length)
        if index == len(uppers):
            raise ValueError(f"length {length} is not below the largest bucket bound {uppers[-1]}")
        total += 1.0 - length / uppers[index]
    return total / len(lengths)


def expected_waste_of_buckets(
    counts: Sequence[int], sums: Sequence[int], uppers: Sequence[int]
) -> float:
    """Eq. 3 from per-bucket request counts and length sums: O(k), no per-request pass."""
    n = sum(counts)
    if n == 0:
        return 0.0
    return sum(c - s / u for c, s, u in zip(counts, sums, uppers, strict=True)) / n
