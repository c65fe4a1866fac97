"""The scheduler's waiting queue, in FCFS or priority order (torch-free)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from runtime.sequence import Sequence

POLICIES = ("fcfs", "priority")


class WaitingQueue:
    """Sequences waiting to start or to resume, front first.

    `fcfs`: arrival order; a sequence put back (preempted, or a sample whose parent has
    computed the prompt) goes to the front. `priority` (vLLM's `scheduling_policy`):
    lowest `Sequence.priority` first, then earliest arrival; a sequence put back keeps its
    place by that key, so it still goes before later arrivals of its priority.

    Under either policy `peek` (the order of the scheduler's SLO admission; `front` is the
    plain one) lets a sequence whose TTFT deadline has passed (`Sequence.is_late`) yield to
    every sequence of its priority that can still meet its own: once a queue forms,
    serving the late one first would only make the on-time ones late too, so a burst past
    capacity costs the SLO of the requests it overflows, not of every request behind it.
    Without deadlines (the offline engine) the order is the policy's alone.
    """

    def __init__(self, policy: str = "fcfs") -> None:
        self.policy = policy
        self._seqs: list[Sequence] = []

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __reversed__(self) -> Iterator[Sequence]:
        return reversed(self._seqs)

    @property
    def front(self) -> Sequence:
        """The first sequence in queue order."""
        return self._seqs[0]

    def peek(
        self,
        now: float,
        lead_s: Callable[[Sequence], float] | None = None,
        yield_s: float | None = None,
    ) -> Sequence:
        """The sequence to start next at time `now` (monotonic): the first in queue order
        that is not late among those of the front's priority; the front if all are late.
        `lead_s(seq)`: the seconds `seq` needs from its start to its first token; one that
        cannot make its deadline even if started now counts as late already. `yield_s`:
        a sequence late by more than this has yielded enough and takes its place back, so
        an overload's late requests wait a bounded time, not until the overload ends."""
        front = self.front
        for seq in self._seqs:
            if seq.priority != front.priority and self.policy == "priority":
                break
            if yield_s is not None and seq.is_late(now - yield_s):
                return seq
            if not seq.is_late(now + (lead_s(seq) if lead_s else 0.0)):
                return seq
        return front

    def push(self, seq: Sequence) -> None:
        """A new arrival."""
        if self.policy == "priority":
            bisect.insort(self._seqs, seq, key=_rank)  # after its equals: ties stay FCFS
        else:
            self._seqs.append(seq)

    def push_front(self, seq: Sequence) -> None:
        """A sequence put back."""
        if self.policy == "priority":
            bisect.insort(self._seqs, seq, key=_rank)
        else:
            self._seqs.insert(0, seq)

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)


def _rank(seq: Sequence) -> tuple[int, float]:
    return seq.priority, seq.arrival_time
