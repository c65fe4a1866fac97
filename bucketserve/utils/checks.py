"""Value checks of the configs that code builds directly (the bucket manager, the retry policy,
decode pacing): a ValueError naming the field and the allowed values. Config files are
checked by their settings models instead (`bucketserve.utils.settings`)."""

from __future__ import annotations

import math
from typing import Any


def check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_number(name: str, value: Any, low: float, high: float = math.inf) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not low <= value <= high or math.isnan(value):
        bound = f"in [{low}, {high}]" if high != math.inf else f">= {low}"
        raise ValueError(f"{name} must be a number {bound}, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}")


def check_pace(where: str, pace: object) -> None:
    ok = isinstance(pace, (int, float)) and not isinstance(pace, bool) and 0 < pace <= 1
    if pace is not None and not ok:
        raise ValueError(
            f"{where} must be null (never hold decode steps) or a fraction of the TPOT target "
            f"in (0, 1], e.g. 0.8; got {pace!r}"
        )
