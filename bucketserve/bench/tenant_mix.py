"""Which tenant sends each request: shares, optionally bound to a workload kind."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TenantShare:
    """`kind` (short / long / sharegpt) binds the tenant to that part of the workload."""

    name: str
    share: float = 1.0
    api_key: str | None = None
    kind: str | None = None

    @classmethod
    def parse(cls, text: str) -> TenantShare:
        """`NAME[:KEY][@KIND][=SHARE]`, e.g. `chat:chat-key@short=0.8`."""
        spec, _, share = text.partition("=")
        spec, _, kind = spec.partition("@")
        name, _, key = spec.partition(":")
        try:
            value = float(share) if share else 1.0
        except ValueError:
            value = -1.0
        if not name or not value > 0:
            raise ValueError(
                f"tenant {text!r}: write NAME[:KEY][@KIND][=SHARE] with a share > 0, "
                "e.g. chat:chat-key@short=0.8"
            )
        return cls(name, value, key or None, kind or None)


class TenantMix:
    """Draws a tenant per request: among those bound to the request's kind if any, else among
    the unbound ones, in proportion to their shares."""

    def __init__(self, tenants: list[TenantShare] | None = None) -> None:
        self.tenants = list(tenants or [TenantShare("default")])
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique, got {names}")

    def keys(self) -> dict[str, str | None]:
        return {t.name: t.api_key for t in self.tenants}

    def pick(self, kind: str, rng: np.random.Generator) -> str:
        pool = [t for t in self.tenants if t.kind == kind] or [
            t for t in self.tenants if t.kind is None
        ]
        if not pool:
            bound = sorted({t.kind for t in self.tenants})
            raise ValueError(
                f"no tenant takes {kind!r} requests: tenants are bound to {bound}; "
                "add an unbound tenant or one with @" + kind
            )
        shares = np.array([t.share for t in pool])
        return pool[int(rng.choice(len(pool), p=shares / shares.sum()))].name
