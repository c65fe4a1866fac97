"""Exact values of the bench metrics on hand-made records."""

from __future__ import annotations

import pytest

from bucketserve.bench.metrics import (
    attainment,
    percentile,
    rate_at_attainment,
    summarize,
)
from bucketserve.bench.request_record import RequestRecord
from bucketserve.bench.slo import SLO


def record(i: int, send: float, first: float | None, end: float | None, tokens: int,
           error: str | None = None, tenant: str = "a", kind: str = "short") -> RequestRecord:
    return RequestRecord(i, tenant, kind, 10, tokens, send_time=send, first_token_time=first,
                         end_time=end, output_tokens=tokens, error=error)


def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 5.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="percentile"):
        percentile(values, 101)


def test_tpot_ttft_e2e_of_a_record() -> None:
    r = record(0, send=10.0, first=10.5, end=12.5, tokens=5)
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.5)  # 2 s over the 4 gaps after the first token
    assert r.e2e == pytest.approx(2.5)
    assert record(1, 0.0, 1.0, 1.0, 1).tpot == 0.0


def test_attainment_counts_failures_as_misses() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    records = [
        record(0, 0.0, 0.5, 1.4, 10),  # ttft 0.5, tpot 0.1: met (bounds inclusive)
        record(1, 0.0, 1.5, 2.0, 10),  # ttft misses
        record(2, 0.0, 0.2, 3.0, 10),  # tpot 0.311 misses
        record(3, 0.0, 0.2, None, 3, error="UNAVAILABLE"),  # failed
    ]
    assert attainment(records, slo) == 0.25
    assert attainment([], slo) == 0.0


def test_summary_throughput_goodput_and_tenants() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=1.0)
    records = [
        record(0, 0.0, 0.5, 2.0, 4, tenant="a"),
        record(1, 1.0, 1.5, 3.0, 6, tenant="a"),
        record(2, 2.0, 4.0, 4.0, 2, tenant="b"),  # ttft 2.0 misses
        record(3, 3.0, None, None, 0, error="boom", tenant="b"),
    ]
    s = summarize(records, slo, offered_rate=1.0)
    assert (s.sent, s.completed, s.failed) == (4, 3, 1)
    assert s.duration_s == 4.0
    assert s.request_throughput == 0.75
    assert s.output_throughput == 3.0  # 12 tokens over 4 s
    assert s.slo_attainment == 0.5
    assert s.goodput == 0.5
    assert s.per_tenant_attainment == {"a": 1.0, "b": 0.0}
    assert s.ttft["p50"] == pytest.approx(0.5)
    assert s.ttft["p99"] == pytest.approx(0.5 + 1.5 * 0.98)
    assert s.errors == ["boom"]


def test_a_kind_judged_by_its_own_targets() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.5, per_kind={"long": (10.0, 0.5)})
    records = [
        record(0, 0.0, 0.5, 1.0, 2),  # short, ttft 0.5: met
        record(1, 0.0, 2.0, 2.5, 2),  # short, ttft 2.0: missed
        record(2, 0.0, 8.0, 8.5, 2, tenant="b", kind="long"),  # long, 8.0 within 10: met
        record(3, 0.0, 12.0, 12.5, 2, tenant="b", kind="long"),  # long, 12.0: missed
        record(4, 0.0, 0.5, 2.0, 2, tenant="b", kind="long"),  # long, tpot 1.5: missed
    ]
    assert slo.targets("long") == (10.0, 0.5) and slo.targets("sharegpt") == (1.0, 0.5)
    s = summarize(records, slo)
    assert s.slo_attainment == 0.4
    assert s.uniform_slo_attainment == 0.2  # only record 0 meets 1.0 s
    assert s.per_kind["long"]["slo_attainment"] == pytest.approx(1 / 3)
    assert s.per_tenant_attainment == {"a": 0.5, "b": pytest.approx(1 / 3)}
    assert summarize(records, slo.uniform).uniform_slo_attainment is None


def test_rate_at_80_percent_is_interpolated() -> None:
    rates = [1.0, 2.0, 3.0, 4.0]
    assert rate_at_attainment(rates, [1.0, 0.9, 0.7, 0.2]) == (pytest.approx(2.5), "interpolated")
    # unsorted input, and a target met exactly at a point
    assert rate_at_attainment([3.0, 1.0, 2.0], [0.5, 1.0, 0.8]) == (
        pytest.approx(2.0), "interpolated"
    )
    assert rate_at_attainment(rates, [1.0, 0.95, 0.9, 0.85]) == (4.0, "above_sweep")
    assert rate_at_attainment(rates, [0.7, 0.5, 0.2, 0.1]) == (None, "below_sweep")
    # the first crossing counts, even when a higher rate recovers (noise)
    assert rate_at_attainment(rates, [0.9, 0.7, 0.85, 0.1])[0] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="equally long"):
        rate_at_attainment([1.0], [])


def test_slo_rejects_non_positive_targets() -> None:
    with pytest.raises(ValueError, match="SLO targets"):
        SLO(ttft_s=0.0, tpot_s=0.1)
    with pytest.raises(ValueError, match="for long requests must be > 0"):
        SLO(ttft_s=1.0, tpot_s=0.1, per_kind={"long": (20.0, 0.0)})
    with pytest.raises(ValueError, match="for the kinds"):
        SLO(ttft_s=1.0, tpot_s=0.1, per_kind={"offline": (20.0, 0.1)})


def test_refused_requests_count_as_misses_and_apart() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=1.0)
    refused = record(2, 0.0, None, None, 0, error="ResourceExhaustedError: late")
    refused.refused = True
    records = [record(0, 0.0, 0.5, 1.0, 4), record(1, 0.0, 2.5, 3.0, 4), refused]
    summary = summarize(records, slo)
    assert summary.slo_attainment == pytest.approx(1 / 3)
    assert summary.refused == 1 and summary.admitted_slo_attainment == 0.5
    assert summarize(records[:2], slo).admitted_slo_attainment is None
