"""One tenant as configured: its bucket-manager policy plus the gateway's keys and quotas."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from bucketserve.bucket_manager.config import TenantConfig
from bucketserve.utils.settings import Settings

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
BURST_SECONDS = 10.0  # default token_burst: this many seconds of token_rate_limit
# keys whose plaintext ships with the project (bucketserve/deploy/serve.yaml): anyone has them
DEMO_API_KEYS = ("interactive-demo-key", "batch-demo-key")


def hash_api_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True)
class TenantSpec:
    """`config` feeds the bucket manager (class, policy, priority, weight, aging, SLOs); the
    rest is enforced at admission. Keys are kept only as sha256 hex digests."""

    config: TenantConfig
    api_key_hashes: frozenset[str] = frozenset()
    max_concurrent_requests: int | None = None
    token_rate_limit: float | None = None  # prompt + output tokens per second
    token_burst: float | None = None  # bucket capacity; default BURST_SECONDS of the rate

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def burst(self) -> float | None:
        if self.token_rate_limit is None:
            return None
        return self.token_burst or max(1.0, BURST_SECONDS * self.token_rate_limit)

    @property
    def demo_keys(self) -> list[str]:
        """The published demo keys this tenant accepts."""
        return [key for key in DEMO_API_KEYS if hash_api_key(key) in self.api_key_hashes]


def _digest(value: str) -> str:
    if not _SHA256_HEX.fullmatch(value):
        raise ValueError("must be 64 lowercase hex digits (the sha256 digest of a key)")
    return value


class TenantSettings(Settings):
    """One entry of the config's `tenants` list."""

    name: str = Field(min_length=1)
    """The tenant's name (metrics, logs, and `default` for the open tenant)."""
    tenant_class: Literal["online", "offline"] = Field("online", alias="class")
    """online: served by earliest arrival; offline: by the tenant's `policy`."""
    policy: Literal["fcfs", "sjf", "ljf"] = "fcfs"
    """Order within the tenant: fcfs, or for offline tenants sjf / ljf (shortest / longest
    job first)."""
    priority: int = 0
    """Lower is served first."""
    weight: float = Field(1.0, gt=0)
    """Fair share against tenants of the same priority."""
    max_wait_s: float | None = Field(30.0, gt=0)
    """Aging bound: a request that waited this long is served next, whatever its priority
    (null: no aging)."""
    ttft_slo_s: float | None = Field(None, gt=0)
    """Time-to-first-token target of the tenant's requests (null: none)."""
    tpot_slo_s: float | None = Field(None, gt=0)
    """Time-per-output-token target of the tenant's requests (null: none)."""
    api_keys: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    """Plaintext keys, hashed when read."""
    api_key_sha256: list[Annotated[str, AfterValidator(_digest)]] = Field(default_factory=list)
    """sha256 hex digests of the keys (the form to keep in a file)."""
    max_concurrent_requests: int | None = Field(None, ge=1)
    """Requests of the tenant in flight at once (null: no bound)."""
    token_rate_limit: float | None = Field(None, gt=0)
    """Prompt + output tokens per second (null: no bound)."""
    token_burst: float | None = Field(None, ge=1)
    """Tokens the rate limit lets through at once (null: 10 s of token_rate_limit)."""
    cache_domain: str | None = Field(None, min_length=1)
    """The prefix-cache domain its requests read and name cached blocks in (null: the
    tenant's own, so no other tenant's request hits its blocks; tenants that trust each
    other name one domain to share them). A request's `cache_salt` narrows it further."""
    cache_share: float | None = Field(None, gt=0, le=1)
    """The fraction of a KV pool's evictable cached blocks the tenant may hold while others
    want room: eviction takes from the tenant most over its share first (null: no bound)."""
    shed: Literal["never", "predicted"] = "never"
    """predicted: a request the queue ahead would make miss its TTFT target (its own, else
    the tenant's `ttft_slo_s`) is answered at once with 429 and Retry-After (gRPC
    RESOURCE_EXHAUSTED with RetryInfo) instead of queueing; offline tenants always queue."""

    @field_validator("api_keys", "api_key_sha256", mode="before")
    @classmethod
    def _one_key(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> TenantSettings:
        if self.token_burst is not None and self.token_rate_limit is None:
            raise ValueError("token_burst needs token_rate_limit")
        self.tenant_config()  # its own rules: an online tenant is served fcfs
        return self

    def tenant_config(self) -> TenantConfig:
        return TenantConfig(
            self.name, self.tenant_class, self.policy, self.priority, self.weight,
            self.max_wait_s, self.ttft_slo_s, self.tpot_slo_s, self.cache_domain,
            self.cache_share, self.shed,
        )

    def spec(self) -> TenantSpec:
        hashes = {*self.api_key_sha256, *(hash_api_key(k) for k in self.api_keys)}
        return TenantSpec(
            self.tenant_config(), frozenset(hashes), self.max_concurrent_requests,
            self.token_rate_limit, self.token_burst,
        )
