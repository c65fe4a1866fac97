"""Throughput, latency percentiles, SLO attainment and goodput of one run (torch-free)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bucketserve.bench.request_record import RequestRecord
from bucketserve.bench.slo import SLO

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    """Share of all sent requests that met the SLO (failed ones count as misses)."""
    return sum(slo.met(r) for r in records) / len(records) if records else 0.0


def span(records: Sequence[RequestRecord]) -> float:
    """First send to last completion, seconds."""
    ends = [r.end_time for r in records if r.end_time is not None]
    if not records or not ends:
        return 0.0
    return max(ends) - min(r.send_time for r in records)


@dataclass
class BenchSummary:
    sent: int
    completed: int
    failed: int
    duration_s: float
    offered_rate: float | None  # requests/s the client offered (None: closed loop)
    request_throughput: float  # completed requests/s
    output_throughput: float  # output tokens/s
    slo_attainment: float
    goodput: float  # requests/s that met the SLO
    refused: int  # answered at once with RESOURCE_EXHAUSTED / 429
    admitted_slo_attainment: float | None  # of the requests not refused (None: none refused)
    uniform_slo_attainment: float | None  # base targets for all (None: no per-kind targets)
    ttft: dict[str, float | None]
    tpot: dict[str, float | None]
    e2e: dict[str, float | None]
    per_tenant_attainment: dict[str, float]
    per_kind: dict[str, dict[str, float | None]]  # attainment, count and TTFT per kind
    errors: list[str]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    records: Sequence[RequestRecord], slo: SLO, offered_rate: float | None = None
) -> BenchSummary:
    done = [r for r in records if r.ok]
    refused = [r for r in records if r.refused]
    duration = span(records)
    per = 1.0 / duration if duration > 0 else 0.0

    def dist(values: list[float]) -> dict[str, float | None]:
        out = {f"p{q}": percentile(values, q) for q in PERCENTILES}
        return out | {"mean": sum(values) / len(values) if values else None}

    tenants = sorted({r.tenant for r in records})
    kinds = sorted({r.kind for r in records})
    return BenchSummary(
        sent=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration,
        offered_rate=offered_rate,
        request_throughput=len(done) * per,
        output_throughput=sum(r.output_tokens for r in done) * per,
        slo_attainment=attainment(records, slo),
        goodput=sum(slo.met(r) for r in records) * per,
        refused=len(refused),
        admitted_slo_attainment=(
            attainment([r for r in records if not r.refused], slo) if refused else None
        ),
        uniform_slo_attainment=attainment(records, slo.uniform) if slo.per_kind else None,
        ttft=dist([r.ttft for r in done if r.ttft is not None]),
        tpot=dist([r.tpot for r in done if r.tpot is not None]),
        e2e=dist([r.e2e for r in done if r.e2e is not None]),
        per_tenant_attainment={
            t: attainment([r for r in records if r.tenant == t], slo) for t in tenants
        },
        per_kind={k: _kind([r for r in records if r.kind == k], slo) for k in kinds},
        errors=sorted({r.error for r in records if r.error})[:10],
    )


def _kind(records: list[RequestRecord], slo: SLO) -> dict[str, float | None]:
    ttfts = [r.ttft for r in records if r.ok and r.ttft is not None]
    return {
        "count": len(records),
        "slo_attainment": attainment(records, slo),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p90": percentile(ttfts, 90),
    }


def rate_at_attainment(
    rates: Sequence[float], attainments: Sequence[float], target: float = 0.8
) -> tuple[float | None, str]:
    """The request rate at which attainment falls to `target`, linearly interpolated between
    the two sweep points (sorted by rate) around its first crossing, and how it was found:
    `interpolated`; `above_sweep` (it holds at every rate: the highest rate, a lower bound);
    `below_sweep` (even the lowest rate misses: None)."""
    if len(rates) != len(attainments) or not rates:
        raise ValueError("rates and attainments must be equally long and non-empty")
    points = sorted(zip(rates, attainments, strict=True))
    if points[0][1] < target:
        return None, "below_sweep"
    for (r0, a0), (r1, a1) in itertools.pairwise(points):
        if a1 < target:
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1), "interpolated"
    return points[-1][0], "above_sweep"
