"""The values of one shape dimension: exponential and linear (with ramp-up) strategies."""

from __future__ import annotations

import bisect
import math

from bucketserve.bucket_manager.config import BucketRange


def exponential_range(rng: BucketRange) -> list[int]:
    """`limit` points spaced exponentially from min to max, each rounded to a multiple of step.

    A point that collides with a value already taken moves to the nearest unused
    multiple of step in [min, max] (ties go down, keeping the small end dense);
    min and max are always present. A range starting at 0 keeps 0 and spaces
    the other `limit - 1` points from `step`.
    """
    lo, step, hi, limit = rng.min, rng.step, rng.max, rng.limit or 1
    if lo == 0:
        rest = BucketRange(min(step, hi), step, hi, max(limit - 1, 1)) if hi else None
        return sorted({0, *(exponential_range(rest) if rest else [])})
    if lo == hi or limit == 1:
        return sorted({lo, hi})
    candidates = sorted({lo, hi, *range(math.ceil(lo / step) * step, hi + 1, step)})
    taken: set[int] = set()
    for i in range(min(limit, len(candidates))):
        point = lo * (hi / lo) ** (i / (limit - 1))
        rounded = lo if i == 0 else hi if i == limit - 1 else math.floor(point / step + 0.5) * step
        taken.add(_nearest_free(candidates, taken, rounded))
    return sorted(taken | {lo, hi})


def _nearest_free(candidates: list[int], taken: set[int], target: int) -> int:
    right = bisect.bisect_left(candidates, target)
    left = right - 1
    while right < len(candidates) and candidates[right] in taken:
        right += 1
    while left >= 0 and candidates[left] in taken:
        left -= 1
    options = [candidates[j] for j in (left, right) if 0 <= j < len(candidates)]
    return min(options, key=lambda c: (abs(c - target), c))


def linear_range(rng: BucketRange) -> list[int]:
    """Ramp-up (min doubled while below step) then the multiples of step up to max.

    min and max are always included, so `max` need not be a multiple of step.
    """
    lo, step, hi = rng.min, rng.step, rng.max
    ramp, value = [], lo
    while value < step and value <= hi:
        ramp.append(value)
        if value == 0:
            break
        value *= 2
    stable = [v for v in range(step, hi + 1, step) if v >= lo]
    return sorted({*ramp, *stable, lo, hi})


def dimension_values(strategy: str, rng: BucketRange) -> list[int]:
    return exponential_range(rng) if strategy == "exponential" else linear_range(rng)


def alpha_range(turning: int, top: int, zero: bool = False) -> list[int]:
    """The unified strategy's alpha points: the whole, half and quarter of `turning`
    (max_num_seqs) and of `top`, plus 0 for a block dimension (`zero`); a point that
    rounds to 0 counts only where 0 does."""
    points = {turning // d for d in (1, 2, 4)} | {top // d for d in (1, 2, 4)}
    return sorted(points | {0} if zero else points - {0})
