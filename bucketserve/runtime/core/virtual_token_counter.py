"""Fair shares of the engine's tokens between tenants: the virtual token counter of Sheng et
al., "Fairness in Serving Large Language Models" (OSDI '24) (torch-free)."""

from __future__ import annotations

from collections.abc import Iterable

from bucketserve.runtime.core.tenant_tag import TenantTag

# The paper's service cost: an output token costs twice a prompt token (w_q = 2 w_p).
PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0


class VirtualTokenCounter:
    """Per tenant, the service it received divided by its weight. The scheduler serves the
    backlogged tenant with the smallest counter first and preempts from the largest. A
    tenant that becomes backlogged again starts at the smallest counter of those already
    backlogged, if that is higher than its own: idle time earns no credit to spend later."""

    def __init__(self) -> None:
        self._counters: dict[str, float] = {}

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def charge(self, tag: TenantTag, prompt_tokens: int, output_tokens: int) -> None:
        cost = PROMPT_TOKEN_COST * prompt_tokens + OUTPUT_TOKEN_COST * output_tokens
        self._counters[tag.name] = self.counter(tag.name) + cost / tag.weight

    def join(self, tenant: str, backlogged: Iterable[str]) -> None:
        """`tenant` has work again, beside the tenants `backlogged` (itself not among them)."""
        floor = min((self.counter(t) for t in backlogged), default=None)
        if floor is not None and floor > self.counter(tenant):
            self._counters[tenant] = floor
