"""Leases on KV blocks held for a handoff, freed if the other side never answers (torch-free)."""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum


class LeaseState(str, Enum):
    OPEN = "open"  # blocks held, waiting for the other side
    RECEIVING = "receiving"  # KV is being written into the blocks: never expires under the writer
    CLOSED = "closed"  # acknowledged: the blocks went on to their sequences
    RELEASED = "released"  # given back unused
    EXPIRED = "expired"  # the deadline passed first


class LeaseError(RuntimeError):
    """A lease that is unknown, already ended, or in the wrong state for the call."""


@dataclass
class Lease:
    lease_id: str
    request_ids: tuple[str, ...]
    block_ids: tuple[tuple[int, ...], ...]
    deadline: float
    state: LeaseState = LeaseState.OPEN
    created: float = field(default_factory=time.monotonic)

    @property
    def num_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.block_ids)

    @property
    def flat_block_ids(self) -> list[int]:
        return [b for blocks in self.block_ids for b in blocks]


@dataclass
class LeaseCounts:
    opened: int = 0
    closed: int = 0
    released: int = 0
    expired: int = 0


class LeaseTable:
    """One worker's live leases. Not thread-safe: the worker calls it under its own lock.

    `free(lease)` gives a lease's blocks back; it runs when a lease is
    released or expires, never when it is closed (then the blocks live on).
    """

    _ENDED_MEMORY = 4096  # ended lease ids remembered, so a late call gets a precise error

    def __init__(self, prefix: str, free: Callable[[Lease], None]) -> None:
        self.prefix = prefix
        self.counts = LeaseCounts()
        self._free = free
        self._live: dict[str, Lease] = {}
        self._ended: OrderedDict[str, LeaseState] = OrderedDict()
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self._live

    def open(
        self,
        request_ids: Sequence[str],
        block_ids: Sequence[Sequence[int]],
        ttl_s: float,
        now: float | None = None,
    ) -> Lease:
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0:
            raise ValueError(f"lease ttl_s must be a positive number of seconds, got {ttl_s!r}")
        if len(request_ids) != len(block_ids):
            raise ValueError("a lease needs one block list per request")
        now = time.monotonic() if now is None else now
        lease = Lease(
            lease_id=f"{self.prefix}-{next(self._ids)}",
            request_ids=tuple(request_ids),
            block_ids=tuple(tuple(b) for b in block_ids),
            deadline=now + ttl_s,
            created=now,
        )
        self._live[lease.lease_id] = lease
        self.counts.opened += 1
        return lease

    def get(self, lease_id: str, *states: LeaseState) -> Lease:
        """The live lease `lease_id`; LeaseError if it ended or is in none of `states`."""
        lease = self._live.get(lease_id)
        if lease is None:
            ended = self._ended.get(lease_id)
            if ended is not None:
                raise LeaseError(f"lease {lease_id} has already {_past(ended)}")
            raise LeaseError(f"unknown lease {lease_id!r} (this worker may have restarted)")
        if states and lease.state not in states:
            wanted = " or ".join(s.value for s in states)
            raise LeaseError(f"lease {lease_id} is {lease.state.value}, not {wanted}")
        return lease

    def begin_receive(self, lease_id: str) -> Lease:
        """KV starts landing in the lease's blocks; from now on it cannot expire."""
        lease = self.get(lease_id, LeaseState.OPEN, LeaseState.RECEIVING)
        lease.state = LeaseState.RECEIVING
        return lease

    def end_receive(self, lease_id: str) -> Lease:
        """The writer is done (all of it landed): the lease may expire again until closed."""
        lease = self.get(lease_id, LeaseState.RECEIVING)
        lease.state = LeaseState.OPEN
        return lease

    def close(self, lease_id: str) -> Lease:
        """The other side acknowledged: the lease ends and its blocks are the caller's."""
        lease = self.get(lease_id, LeaseState.OPEN, LeaseState.RECEIVING)
        return self._end(lease, LeaseState.CLOSED)

    def release(self, lease_id: str) -> Lease:
        """Give the blocks back unused."""
        lease = self.get(lease_id)
        self._free(lease)
        return self._end(lease, LeaseState.RELEASED)

    def expire(self, now: float | None = None) -> list[Lease]:
        """End (and free) every open lease whose deadline has passed; returns them."""
        now = time.monotonic() if now is None else now
        due = [
            lease
            for lease in self._live.values()
            if lease.state == LeaseState.OPEN and lease.deadline <= now
        ]
        for lease in due:
            self._free(lease)
            self._end(lease, LeaseState.EXPIRED)
        return due

    def release_all(self) -> list[Lease]:
        """Shutdown: free every live lease."""
        leases = list(self._live.values())
        for lease in leases:
            self._free(lease)
            self._end(lease, LeaseState.RELEASED)
        return leases

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self._live.values()), default=None)

    def _end(self, lease: Lease, state: LeaseState) -> Lease:
        lease.state = state
        del self._live[lease.lease_id]
        self._ended[lease.lease_id] = state
        while len(self._ended) > self._ENDED_MEMORY:
            self._ended.popitem(last=False)
        setattr(self.counts, state.value, getattr(self.counts, state.value) + 1)
        return lease


def _past(state: LeaseState) -> str:
    return {"closed": "been acknowledged", "released": "been released"}.get(
        state.value, "expired"
    )
