"""One tenant as configured: its bucket-manager policy plus the gateway's keys and quotas."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from bucketserve.bucket_manager.config import TenantConfig, check_int, check_number

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
BURST_SECONDS = 10.0  # default token_burst: this many seconds of token_rate_limit


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

    # keys of a tenant mapping that belong to the gateway; the rest go to TenantConfig
    GATEWAY_KEYS = (
        "api_keys",
        "api_key_sha256",
        "max_concurrent_requests",
        "token_rate_limit",
        "token_burst",
    )

    def __post_init__(self) -> None:
        where = f"tenant {self.name!r}"
        object.__setattr__(self, "api_key_hashes", frozenset(self.api_key_hashes))
        bad = sorted(h for h in self.api_key_hashes if not _SHA256_HEX.fullmatch(str(h)))
        if bad:
            raise ValueError(f"{where}: api_key_sha256 entries must be 64 lowercase hex digits")
        if self.max_concurrent_requests is not None:
            check_int(f"{where}: max_concurrent_requests", self.max_concurrent_requests, 1)
        if self.token_rate_limit is not None:
            check_number(f"{where}: token_rate_limit", self.token_rate_limit, 1e-9)
        if self.token_burst is not None:
            if self.token_rate_limit is None:
                raise ValueError(f"{where}: token_burst needs token_rate_limit")
            check_number(f"{where}: token_burst", self.token_burst, 1.0)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def burst(self) -> float | None:
        if self.token_rate_limit is None:
            return None
        return self.token_burst or max(1.0, BURST_SECONDS * self.token_rate_limit)

    def has_key(self, key_hash: str) -> bool:
        return key_hash in self.api_key_hashes

    @classmethod
    def from_dict(cls, data: Any, where: str = "tenant") -> TenantSpec:
        """From a mapping with TenantConfig's keys (`class` for tenant_class) plus
        GATEWAY_KEYS; `api_keys` are plaintext and hashed at once, `api_key_sha256` are
        digests already."""
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")
        if "name" not in data:
            raise ValueError(f"{where}: name is required")
        gateway = {k: data[k] for k in cls.GATEWAY_KEYS if k in data}
        rest = {k: v for k, v in data.items() if k not in gateway}
        try:
            config = TenantConfig.from_dict(rest, where)
        except ValueError as exc:
            if "unknown keys" not in str(exc):
                raise ValueError(f"{where}: {exc}") from None
            raise ValueError(f"{exc}; or one of {list(cls.GATEWAY_KEYS)}") from None
        hashes = set(_strings(gateway.pop("api_key_sha256", []), f"{where}.api_key_sha256"))
        keys = _strings(gateway.pop("api_keys", []), f"{where}.api_keys")
        hashes.update(hash_api_key(k) for k in keys)
        try:
            return cls(config, frozenset(hashes), **gateway)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


def _strings(value: Any, where: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{where} must be a list of non-empty strings")
    return list(value)
