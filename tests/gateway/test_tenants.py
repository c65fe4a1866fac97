"""Tenants from a config mapping: validation naming the key, hashed keys, quotas."""

from __future__ import annotations

import pytest

from bucketserve.bucket_manager.config import BucketManagerConfig, TenantConfig, hash_api_key
from bucketserve.gateway.errors import (
    AuthenticationError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from bucketserve.gateway.tenant_quota import TenantQuota
from bucketserve.gateway.tenant_registry import TenantRegistry, parse_bearer
from bucketserve.gateway.token_bucket import TokenBucket

TENANTS = [
    {
        "name": "alice",
        "api_keys": ["alice-key-1", "alice-key-2"],
        "class": "online",
        "priority": 0,
        "weight": 2.0,
        "max_concurrent_requests": 4,
        "token_rate_limit": 100.0,
        "ttft_slo_s": 0.5,
    },
    {
        "name": "batch",
        "api_key_sha256": [hash_api_key("batch-key")],
        "class": "offline",
        "policy": "sjf",
        "priority": 1,
    },
]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_registry_from_list_feeds_the_bucket_manager() -> None:
    registry = TenantRegistry.from_dict(TENANTS)
    configs = registry.bucket_configs()
    assert [c.name for c in configs] == ["alice", "batch"]
    alice, batch = configs
    assert (alice.tenant_class, alice.policy) == ("online", "fcfs")
    assert (alice.weight, alice.ttft_slo_s) == (2.0, 0.5)
    assert (batch.tenant_class, batch.policy) == ("offline", "sjf")
    assert batch.priority == 1
    assert BucketManagerConfig(tenants=configs).tenants == configs  # the manager takes them


def test_registry_from_mapping_by_name() -> None:
    registry = TenantRegistry.from_dict({"a": {"api_keys": ["k1"]}, "b": {"api_keys": ["k2"]}})
    assert registry.authenticate("k2").name == "b"


def test_keys_are_stored_hashed_only() -> None:
    registry = TenantRegistry.from_dict(TENANTS)
    alice = registry.tenants["alice"]
    assert alice.api_key_hashes == {hash_api_key("alice-key-1"), hash_api_key("alice-key-2")}
    assert "alice-key-1" not in repr(alice)
    assert "alice-key-1" not in repr(registry.__dict__)


def test_authenticate() -> None:
    registry = TenantRegistry.from_dict(TENANTS)
    assert registry.auth_required
    assert registry.authenticate("alice-key-2").name == "alice"
    assert registry.authenticate("batch-key").name == "batch"
    with pytest.raises(AuthenticationError, match="needs an API key"):
        registry.authenticate(None)
    with pytest.raises(AuthenticationError, match="not valid"):
        registry.authenticate("nope")


def test_open_registry_is_default_tenant_without_keys() -> None:
    registries = (TenantRegistry(), TenantRegistry.from_dict(None), TenantRegistry.from_dict([]))
    for registry in registries:
        assert not registry.auth_required
        spec = registry.authenticate(None)
        assert spec.name == "default"
        assert registry.authenticate("anything").name == "default"
        assert registry.bucket_configs() == (
            TenantConfig(name="default", ttft_slo_s=4.0, tpot_slo_s=0.25),
        )


def test_a_lone_default_tenant_without_keys_sets_its_targets_and_stays_open() -> None:
    registry = TenantRegistry.from_dict({"default": {"ttft_slo_s": 1.5, "max_wait_s": None}})
    assert not registry.auth_required
    assert registry.authenticate(None) == TenantConfig(
        name="default", ttft_slo_s=1.5, max_wait_s=None
    )
    keyed = TenantRegistry.from_dict([{"name": "default", "api_keys": ["k"]}])
    assert keyed.auth_required  # with a key it guards the service as any tenant does
    with pytest.raises(AuthenticationError):
        keyed.authenticate(None)
    with pytest.raises(ValueError, match="tenant 'default' has no api_keys"):
        TenantRegistry.from_dict([{"name": "default"}, {"name": "x"}])


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"api_keys": ["k"]}, r"tenants\[0\]: name is required"),
        ({"name": "x", "api_keys": ["k"], "colour": 1},
         r"tenants\[0\]\.colour: unknown key 'colour'"),
        ({"name": "x", "api_keys": ["k"], "policy": "sjf"}, "online tenants"),
        ({"name": "x", "api_keys": ["k"], "class": "batchy"},
         r"tenants\[0\]\.class: must be one of 'online', 'offline', got 'batchy'"),
        ({"name": "x", "api_keys": ["k"], "max_concurrent_requests": 0}, "max_concurrent_requests"),
        ({"name": "x", "api_keys": ["k"], "token_rate_limit": -1}, "token_rate_limit"),
        ({"name": "x", "api_keys": ["k"], "token_burst": 10}, "token_burst needs token_rate"),
        ({"name": "x", "api_keys": [""]}, r"tenants\[0\].api_keys"),
        ({"name": "x", "api_key_sha256": ["abc"]}, "64 lowercase hex"),
        ({"name": "x"}, "has no api_keys"),
        ("alice", r"tenants\[0\]: must be a mapping"),
    ],
)
def test_bad_tenant_entries_name_the_key(entry: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TenantRegistry.from_dict([entry])


def test_duplicate_names_and_shared_keys() -> None:
    a1, a2, b1 = ({"name": n, "api_keys": [k]} for n, k in (("a", "1"), ("a", "2"), ("b", "1")))
    with pytest.raises(ValueError, match="duplicate names"):
        TenantRegistry.from_dict([a1, a2])
    with pytest.raises(ValueError, match="share an API key"):
        TenantRegistry.from_dict([a1, b1])


def test_parse_bearer() -> None:
    assert parse_bearer("Bearer abc") == "abc"
    assert parse_bearer("bearer  abc ") == "abc"
    assert parse_bearer(None) is None
    assert parse_bearer("Basic xyz") == "Basic xyz"  # fails later as an unknown key


def test_concurrency_quota_refuses_without_state_change() -> None:
    quota = TenantQuota(TenantConfig(name="t", max_concurrent_requests=2))
    quota.acquire(10)
    quota.acquire(10)
    with pytest.raises(ResourceExhaustedError, match="max_concurrent_requests") as info:
        quota.acquire(10)
    assert info.value.retry_after_s > 0
    assert quota.running == 2
    quota.release()
    quota.acquire(10)
    assert quota.running == 2


def test_token_rate_quota_with_retry_after_and_refund() -> None:
    clock = FakeClock()
    spec = TenantConfig(name="t", token_rate_limit=10.0, token_burst=50.0)
    quota = TenantQuota(spec, clock)
    quota.acquire(40)
    with pytest.raises(ResourceExhaustedError, match="token rate limit") as info:
        quota.acquire(30)  # 10 left, 20 short at 10/s
    assert info.value.retry_after_s == pytest.approx(2.0)
    assert quota.running == 1
    assert quota.bucket is not None and quota.bucket.level == pytest.approx(10.0)
    quota.release(unused_tokens=25)  # the request generated less than max_tokens
    assert quota.bucket.level == pytest.approx(35.0)
    clock.now = 1.5
    quota.acquire(30)
    assert quota.bucket.level == pytest.approx(20.0)


def test_request_larger_than_burst_is_invalid_not_retryable() -> None:
    quota = TenantQuota(TenantConfig(name="t", token_rate_limit=1.0, token_burst=20.0))
    with pytest.raises(InvalidArgumentError, match="at most 20"):
        quota.acquire(21)
    assert quota.running == 0
    assert quota.bucket is not None and quota.bucket.level == 20.0


def test_default_burst_is_ten_seconds_of_rate() -> None:
    assert TenantConfig(name="t", token_rate_limit=7.0).burst == 70.0


def test_token_bucket_refills_up_to_capacity() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=4.0, capacity=8.0, clock=clock)
    assert bucket.take(8) == 0.0
    assert bucket.take(2) == pytest.approx(0.5)
    clock.now = 100.0
    assert bucket.level == 8.0
    bucket.give_back(5)
    assert bucket.level == 8.0
