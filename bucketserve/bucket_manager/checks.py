"""Field checks every config of the service uses: a ValueError naming the field and the
allowed values."""

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
