"""What the bucket manager tells the TTFT forecast: the prompt tokens served before a new
request (its tenant's queue, better priorities whole, equal priorities by fair share), what
they cost (PrefillCost), how far forecasts fell from first tokens (ForecastBias), and fair
shares that count output tokens; the tenant settings' checks."""

from __future__ import annotations

import re

import pytest

from bucketserve.bucket_manager import TenantConfig
from bucketserve.bucket_manager.prefill_cost import (
    ForecastBias,
    PrefillCost,
    absorbs,
    some_worker_absorbs,
)
from tests.bucket_manager.helpers import make_manager, req

A = TenantConfig(name="a", priority=0, weight=1.0)
B = TenantConfig(name="b", priority=0, weight=3.0)
URGENT = TenantConfig(name="urgent", priority=-1)
LATER = TenantConfig(name="later", priority=1)


def test_tokens_ahead_weigh_priority_and_fair_share() -> None:
    m = make_manager(A, B, URGENT, LATER)
    m.add(req("a1", 100, tenant="a"))
    m.add(req("b1", 900, tenant="b"))
    m.add(req("u1", 50, tenant="urgent"))
    m.add(req("x1", 700, tenant="later"))
    # a's new 20-token request: a's 100 queued, urgent's 50 whole, b's turn meanwhile
    # (weight 3 to 1: 3 x (100 + 20) = 360 of its 900), nothing of `later`
    assert m.tokens_ahead("a", 20) == 100 + 50 + 360
    # b's: its own 900, a's whole 100 (its turn, 1/3 of 920, is larger), urgent's 50
    assert m.tokens_ahead("b", 20) == 900 + 100 + 50
    assert m.tokens_ahead("later", 10) == 700 + 100 + 900 + 50
    m.add(req("a2", 60, tenant="a", cached_len=40))  # only its 20 computed tokens count
    assert m.tokens_ahead("urgent", 1) == 50
    assert m.tokens_ahead("a", 20) == 120 + 50 + 3 * 140
    m.remove("a1")
    assert m.tokens_ahead("a", 20) == 20 + 50 + 3 * 40


def test_fair_shares_count_output_tokens() -> None:
    m = make_manager(A, TenantConfig(name="c", priority=0, weight=1.0))
    m.add(req("a1", 64, tenant="a"))
    m.add(req("c1", 64, tenant="c"))
    first = m.next_batch(1000, 128, 0.0)
    assert first.tenant == "a"  # a tie: by name
    m.charge_output("a", 500)  # a's long generation
    m.add(req("a2", 64, tenant="a"))
    assert m.next_batch(1000, 128, 0.0).tenant == "c"
    assert m.snapshot().tokens_served_by_tenant["a"] == 64 + 500
    assert m.next_batch(1000, 128, 0.0).tenant == "a"


def test_prefill_cost_prices_steps_and_tokens_over_the_workers() -> None:
    workers = PrefillCost(prefill_token_s=0.001, workers=2)
    assert workers.seconds(1000) == pytest.approx(0.5)
    colocated = PrefillCost(prefill_token_s=0.001, step_s=0.05, step_tokens=256)
    assert colocated.seconds(100) == pytest.approx(0.05 + 0.1)  # one step
    assert colocated.seconds(1000) == pytest.approx(4 * 0.05 + 1.0)  # four steps of 256


def test_a_prompt_is_absorbed_only_within_the_running_requests_tpot_slack() -> None:
    assert absorbs(100, 0.001, 0.1)  # 0.1 s of prefill, 0.1 s of slack
    assert not absorbs(101, 0.001, 0.1)
    assert absorbs(10_000, 0.001, None)  # no running request with a target it can meet
    assert absorbs(10_000, None, 0.01)  # nothing measured: nothing to go by


def test_a_worker_must_absorb_every_prompt_token_computed_before_the_request() -> None:
    tight = (20, 0.001, 0.1)  # 20 tokens sent to it, 1 ms a token, 0.1 s of TPOT slack
    assert some_worker_absorbs(80, 0, [tight])  # 100 tokens: 0.1 s
    assert not some_worker_absorbs(50, 40, [tight])  # its own alone would fit: 110
    assert some_worker_absorbs(50, 40, [tight, tight])  # the 40 ahead split over two: 90
    assert not some_worker_absorbs(81, 0, [tight, (0, 0.001, 0.05)])
    assert some_worker_absorbs(10_000, 0, [tight, None])  # one not reported yet
    assert not some_worker_absorbs(1, 0, [])  # no decode worker alive


def test_a_forecast_is_corrected_by_the_high_quantile_of_recent_misses() -> None:
    bias = ForecastBias(window=10, quantile=0.9)
    assert bias.correct(1.0) == 1.0  # nothing seen: the cost model as it is
    for late in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 2.0):
        bias.observe(1.0, 1.0 + late)
    assert bias.correct(1.0) == pytest.approx(3.0)  # the 90th percentile of ten: the worst
    bias.observe(1.0, 1.9)  # the window drops the oldest (0.0): 0.1 .. 0.8, 2.0, 0.9
    assert len(bias.residuals) == 10
    assert bias.correct(0.5) == pytest.approx(2.5)
    for _ in range(10):  # forecasts that come early leave forecasts as they are
        bias.observe(1.0, 0.5)
    assert bias.correct(1.0) == 1.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cache_share": 0.0}, "cache_share: must be a number in (0, 1] or null, got 0.0"),
        ({"cache_share": 1.5}, "cache_share: must be a number in (0, 1] or null, got 1.5"),
        ({"cache_domain": ""}, "cache_domain: must be a non-empty string"),
        ({"shed": "sometimes"}, "shed: must be one of 'never', 'predicted', got 'sometimes'"),
    ],
)
def test_tenant_cache_and_shed_settings_are_checked(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"tenants[0].{message}")):
        TenantConfig.parse({"name": "t", **fields}, "tenants[0]")


def test_only_online_tenants_shed_and_a_domain_defaults_to_the_tenant() -> None:
    assert TenantConfig(name="t", shed="predicted").sheds
    assert not TenantConfig(name="t", tenant_class="offline", policy="sjf", shed="predicted").sheds
    assert not TenantConfig(name="t").sheds
    assert TenantConfig(name="t").tag().cache_domain == "t"
    tag = TenantConfig(name="t", weight=2.0, cache_domain="team").tag("salt")
    assert (tag.name, tag.weight, tag.cache_domain, tag.cache_salt) == ("t", 2.0, "team", "salt")
