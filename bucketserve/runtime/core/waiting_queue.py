"""The scheduler's waiting queue, in FCFS or priority order (torch-free)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Iterator

from bucketserve.runtime.core.sequence import Priority, Sequence
from bucketserve.runtime.core.virtual_token_counter import VirtualTokenCounter

POLICIES = ("fcfs", "priority")


class WaitingQueue:
    """Sequences waiting to start or to resume, front first.

    `fcfs`: arrival order; a sequence put back (preempted, or a sample whose parent has
    computed the prompt) goes to the front. `priority` (vLLM's `scheduling_policy`):
    lowest `Sequence.priority` first, then earliest arrival; a sequence put back keeps its
    place by that key, so it still goes before later arrivals of its priority.

    Under either policy `peek` (the order of the scheduler's SLO admission; `first` is the
    plain one) lets a sequence whose TTFT deadline has passed (`Sequence.is_late`) yield to
    those of its priority that can still meet their own, when serving it first would make
    one of them late too: so a burst past capacity costs the SLO of the requests it
    overflows, not of every request behind it, while below capacity a late request does
    not wait behind others that can spare the time. Without deadlines (the offline engine)
    the order is the policy's alone.

    With `fair` (a `VirtualTokenCounter`) under the priority policy, tenants of one tenant
    priority (a priority tuple's first element) take turns by their counters: the queue
    order is tenant priority, then the tenant's counter, then the rest of the priority and
    arrival. With one tenant this is the priority order.
    """

    def __init__(self, policy: str = "fcfs", fair: VirtualTokenCounter | None = None) -> None:
        self.policy = policy
        self.fair = fair if policy == "priority" else None
        self._seqs: list[Sequence] = []

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._ordered())

    def __reversed__(self) -> Iterator[Sequence]:
        return reversed(self._ordered())

    def tenants(self) -> set[str]:
        return {seq.tenant.name for seq in self._seqs}

    def first(self, skip: Collection[int | str] = ()) -> Sequence | None:
        """The first sequence in queue order whose id is not in `skip` (None: no such one)."""
        return next((seq for seq in self._ordered() if seq.seq_id not in skip), None)

    def _ordered(self) -> list[Sequence]:
        """The queue in its order: kept sorted, but for the tenants' turns, sorted here."""
        fair = self.fair
        if fair is None or len(self._seqs) < 2:
            return self._seqs
        first = self._seqs[0].tenant.name
        if all(seq.tenant.name == first for seq in self._seqs):
            return self._seqs
        return sorted(self._seqs, key=lambda seq: _fair_rank(seq, fair))

    def level(self, seq: Sequence) -> Priority:
        """What a sequence's turn is compared by before its arrival: its whole priority, or
        its tenant priority alone when tenants take turns."""
        if self.fair is not None and isinstance(seq.priority, tuple):
            return seq.priority[0]
        return seq.priority

    def peek(
        self,
        now: float,
        lead_s: Callable[[Sequence, int], float] | None = None,
        yield_s: float | None = None,
        skip: Collection[int | str] = (),
    ) -> Sequence | None:
        """The sequence to start next at time `now` (monotonic), among those of the front's
        priority: the first in queue order, unless it is late and starting it first would
        make one behind it that is still on time late too; then the first on time.
        Sequences whose ids are in `skip` (those that cannot start this step) are passed
        over as if absent; None if every sequence is.

        `lead_s(seq, ahead)`: the seconds `seq` needs from its start to its first token
        when `ahead` more prompt tokens are computed before it (none given: no time, so
        queue order); one that cannot make its deadline even if started now counts as late
        already. A late sequence yields only to those it would cost their deadline, so
        below capacity it loses no more time than queue order gives it. `yield_s`: a
        sequence late by more than this has yielded enough and keeps its place, so an
        overload's late requests wait a bounded time, not until the overload ends."""
        ordered = self._ordered()
        front = next((seq for seq in ordered if seq.seq_id not in skip), None)
        if front is None:
            return None
        lead_s = lead_s or _no_lead
        late: Sequence | None = None  # the first in queue order that may yield
        first_on_time: Sequence | None = None
        ahead = 0  # prompt tokens of the sequences on time between `late` and the one looked at
        for seq in ordered:
            if seq.seq_id in skip:
                continue
            if self.policy == "priority" and self.level(seq) != self.level(front):
                break
            overdue = yield_s is not None and seq.is_late(now - yield_s)
            if not overdue and seq.is_late(now + lead_s(seq, 0)):
                late = late or seq
                continue
            if late is None:
                return seq
            first_on_time = first_on_time or seq
            with_late = seq.is_late(now + lead_s(seq, ahead + late.num_uncomputed_tokens))
            if with_late and not seq.is_late(now + lead_s(seq, ahead)):
                return first_on_time
            ahead += seq.num_uncomputed_tokens
        return late or front

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


def _rank(seq: Sequence) -> tuple[Priority, float]:
    return seq.priority, seq.arrival_time


def _fair_rank(seq: Sequence, fair: VirtualTokenCounter) -> tuple:
    p = seq.priority if isinstance(seq.priority, tuple) else (seq.priority,)
    return p[0], fair.counter(seq.tenant.name), p[1:], seq.arrival_time


def _no_lead(seq: Sequence, ahead: int) -> float:
    return 0.0
