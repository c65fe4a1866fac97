"""Who may call: tenants by API key, or everyone as `default` when none are configured."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bucketserve.bucket_manager.config import (
    DEFAULT_TENANT,
    TenantConfig,
    default_tenant,
    hash_api_key,
)
from bucketserve.gateway.errors import AuthenticationError
from bucketserve.gateway.tenant_quota import TenantQuota
from bucketserve.utils.settings import SettingsError


class TenantRegistry:
    """With no tenants every request belongs to the online FCFS tenant `default` and needs
    no key (vLLM without --api-key); a lone tenant named `default` without keys sets that
    tenant's targets and limits and keeps the service open. Otherwise each request must
    carry a tenant's key."""

    def __init__(self, tenants: Sequence[TenantConfig] = ()) -> None:
        tenants = list(tenants) or [default_tenant()]
        lone = tenants[0] if len(tenants) == 1 else None
        open_default = lone is not None and lone.name == DEFAULT_TENANT and not lone.api_key_hashes
        self.auth_required = not open_default
        self.tenants = {t.name: t for t in tenants}
        if len(self.tenants) != len(tenants):
            names = [t.name for t in tenants]
            duplicates = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"tenants: duplicate names {duplicates}")
        self._by_hash: dict[str, str] = {}
        for tenant in tenants:
            for key_hash in tenant.api_key_hashes:
                other = self._by_hash.setdefault(key_hash, tenant.name)
                if other != tenant.name:
                    raise ValueError(f"tenants {other!r} and {tenant.name!r} share an API key")
            if self.auth_required and not tenant.api_key_hashes:
                raise ValueError(f"tenant {tenant.name!r} has no api_keys; give it at least one")
        self.quotas = {name: TenantQuota(t) for name, t in self.tenants.items()}

    @classmethod
    def from_dict(cls, data: Any, where: str = "tenants") -> TenantRegistry:
        """From a list of tenant mappings, or a mapping of name to settings; None or empty
        for the open `default` tenant. A SettingsError (a ValueError) names the entry and
        the key."""
        if data is None:
            return cls()
        if isinstance(data, dict):
            items = [(f"{where}.{name}", _named(name, v)) for name, v in data.items()]
        elif isinstance(data, (list, tuple)):
            items = [(f"{where}[{i}]", v) for i, v in enumerate(data)]
        else:
            raise SettingsError(where, "must be a list of tenant mappings or a mapping by name")
        return cls([TenantConfig.parse(v, w) for w, v in items])

    def authenticate(self, api_key: str | None) -> TenantConfig:
        """The caller's tenant; AuthenticationError for a missing or unknown key."""
        if not self.auth_required:
            return self.tenants[DEFAULT_TENANT]
        if not api_key:
            raise AuthenticationError(
                "this server needs an API key: send 'authorization: Bearer <key>'"
            )
        name = self._by_hash.get(hash_api_key(api_key))
        if name is None:
            raise AuthenticationError("the API key is not valid for any tenant; check the key")
        return self.tenants[name]

    def bucket_configs(self) -> tuple[TenantConfig, ...]:
        return tuple(self.tenants.values())


def parse_bearer(authorization: str | None) -> str | None:
    """The key in an `authorization: Bearer <key>` header (the raw value if not in that form,
    so a malformed header fails as an unknown key)."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" else authorization.strip()


def _named(name: str, settings: Any) -> Any:
    """A tenant given as `name: {settings}` as a list entry (its settings may be empty)."""
    if settings is None:
        return {"name": name}
    return {"name": name, **settings} if isinstance(settings, dict) else settings
