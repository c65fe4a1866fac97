"""Whose a request is, as the engine core needs it (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from bucketserve.runtime.core.block_hash import BlockHash, domain_root


@dataclass(frozen=True)
class TenantTag:
    """`name` and `weight`: the tenant's fair share of the engine's tokens (the scheduler's
    virtual token counter); `cache_domain`: the prefix-cache domain its blocks are named in
    (None: the one domain of a service without tenants, and of the offline engine), narrowed
    by the request's `cache_salt`. Blocks it computes count against its cache share."""

    name: str = "default"
    weight: float = 1.0
    cache_domain: str | None = None
    cache_salt: str | None = None

    @property
    def cache_root(self) -> BlockHash:
        return domain_root(self.cache_domain, self.cache_salt)


DEFAULT_TENANT = TenantTag()
