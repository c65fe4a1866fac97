"""What the bucket manager knows about a request: lengths, tenant, arrival, priority."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from bucketserve.utils.checks import check_int

T = TypeVar("T")


@dataclass(frozen=True)
class BucketRequest(Generic[T]):
    """A request waiting for prefill. `item` is its owner's, carried untouched (the
    controller's RequestState).

    Lower `priority` is served first within its tenant. `samples` (n > 1) generate from
    one prompt, sharing its KV blocks.

    `cached_len` leading prompt tokens are expected in a worker's prefix cache (an estimate
    made when queued; the last token is always computed), so a request is bucketed, padded
    and ordered by the tokens it computes, `effective_len`; its KV still holds the whole
    prompt. `block_hashes` name its prompt's full blocks (`runtime.core.block_hash`), for
    placement by cache.
    """

    request_id: Hashable
    prompt_len: int
    max_tokens: int | None = None
    tenant: str = "default"
    arrival_time: float = 0.0
    priority: int = 0
    item: T = field(default=None, compare=False, repr=False)  # type: ignore[assignment]
    samples: int = 1
    cached_len: int = 0
    block_hashes: tuple[int, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        where = f"request {self.request_id!r}"
        check_int(f"{where}: prompt_len", self.prompt_len, 1)
        if self.max_tokens is not None:
            check_int(f"{where}: max_tokens", self.max_tokens, 1)
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ValueError(f"{where}: tenant must be a non-empty string, got {self.tenant!r}")
        arrival = self.arrival_time
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)):
            raise ValueError(f"{where}: arrival_time must be a number, got {arrival!r}")
        if not math.isfinite(arrival):
            raise ValueError(f"{where}: arrival_time must be finite, got {arrival!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"{where}: priority must be an integer, got {self.priority!r}")
        check_int(f"{where}: samples", self.samples, 1)
        check_int(f"{where}: cached_len", self.cached_len, 0)
        if self.cached_len >= self.prompt_len:
            raise ValueError(
                f"{where}: cached_len {self.cached_len} must leave at least one of the "
                f"{self.prompt_len} prompt tokens to compute"
            )

    @property
    def effective_len(self) -> int:
        """Prompt tokens its prefill computes: those not expected in a prefix cache."""
        return self.prompt_len - self.cached_len

    @property
    def expected_work(self) -> int:
        """Tokens it computes, prefill and decode: SJF's and LJF's job length."""
        return self.effective_len + (self.max_tokens or 0)

    @property
    def expected_len(self) -> int:
        """Prompt plus the most tokens it may generate (the prompt alone without max_tokens)."""
        return self.prompt_len + (self.max_tokens or 0)

    def kv_tokens(self, count_output_tokens: bool) -> int:
        return self.expected_len if count_output_tokens else self.prompt_len
