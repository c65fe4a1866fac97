"""Plain-text tables and JSON files for the experiments."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = [title, "  " + "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  " + "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def write_json(path: Path, data: Any) -> Path:
    """`data` with floats cut to 5 significant digits (the results get committed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_rounded(data), indent=1, default=str) + "\n")
    return path


def _rounded(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.5g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def rate_at(rates: Sequence[float], attainment: Sequence[float], target: float = 0.8) -> float:
    """The rate where attainment first falls through `target`, linearly interpolated; the
    highest rate tried when it never does, 0 when even the lowest misses it."""
    if not rates:
        raise ValueError("need at least one rate")
    if attainment[0] < target:
        return 0.0
    points = list(zip(rates, attainment, strict=True))
    for (r0, a0), (r1, a1) in itertools.pairwise(points):
        if a1 < target <= a0:
            return r0 + (a0 - target) / (a0 - a1) * (r1 - r0)
    return rates[-1]
