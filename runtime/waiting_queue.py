"""The scheduler's waiting queue, in FCFS or priority order (torch-free)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

from runtime.sequence import Sequence

POLICIES = ("fcfs", "priority")


class WaitingQueue:
    """Sequences waiting to start or to resume, front first.

    `fcfs`: arrival order; a sequence put back (preempted, or a sample whose parent has
    computed the prompt) goes to the front. `priority` (vLLM's `scheduling_policy`):
    lowest `Sequence.priority` first, then earliest arrival; a sequence put back keeps its
    place by that key, so it still goes before later arrivals of its priority.
    """

    def __init__(self, policy: str = "fcfs") -> None:
        self.policy = policy
        self._seqs: list[Sequence] = []
        self._keys: list[tuple[int, float, int]] = []  # priority policy: sorted, like _seqs
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __reversed__(self) -> Iterator[Sequence]:
        return reversed(self._seqs)

    def peek(self) -> Sequence:
        return self._seqs[0]

    def pop(self) -> Sequence:
        if self.policy == "priority":
            self._keys.pop(0)
        return self._seqs.pop(0)

    def push(self, seq: Sequence) -> None:
        """A new arrival."""
        if self.policy == "priority":
            self._insert(seq)
        else:
            self._seqs.append(seq)

    def push_front(self, seq: Sequence) -> None:
        """A sequence put back."""
        if self.policy == "priority":
            self._insert(seq)
        else:
            self._seqs.insert(0, seq)

    def remove(self, seq: Sequence) -> None:
        i = self._seqs.index(seq)
        del self._seqs[i]
        if self.policy == "priority":
            del self._keys[i]

    def _insert(self, seq: Sequence) -> None:
        key = (seq.priority, seq.arrival_time, next(self._order))
        i = bisect.bisect(self._keys, key)
        self._keys.insert(i, key)
        self._seqs.insert(i, seq)
