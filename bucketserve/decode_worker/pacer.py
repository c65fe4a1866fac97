"""Decode pacing: a decode step waits while every running sequence is ahead of its TPOT
target, so a prefill batch on the same cores gets them (torch-free)."""

from __future__ import annotations

from collections.abc import Iterable

from bucketserve.runtime.core.sequence import Sequence


class DecodePacer:
    """How long the next decode step may wait.

    A decode step has a large fixed cost (the weights are read once a step, whatever the
    batch), so on cores that a prefill worker shares, decoding faster than the requests'
    TPOT targets takes time from the prompts queued behind that prefill. While a prefill
    batch for this worker is in flight, the step waits until the running sequence closest
    to its target would otherwise see its next token later than `fraction` of it: each
    sequence's next token is due `fraction x tpot_target` after its last one, and the step
    must start `step_s` (its expected length: the scheduler's `StepTimes.decode_s`) before
    the earliest of those.

    Nothing waits for a sequence without a target or a first token from this worker (a
    newly admitted one: its first token is its TTFT), nor while a sequence waits to be
    (re)computed.
    """

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.held_s = 0.0  # seconds steps were held, since start

    def hold_s(self, running: Iterable[Sequence], waiting: int, now: float, step_s: float) -> float:
        """Seconds the next step may wait from `now`; 0 when it must run now."""
        if waiting:
            return 0.0
        due = None
        for seq in running:
            target, last = seq.tpot_target, seq.metrics.last_token_time
            if target is None or last is None or seq.num_uncomputed_tokens != 1:
                return 0.0
            when = last + self.fraction * target
            due = when if due is None else min(due, when)
        if due is None:
            return 0.0
        return max(0.0, due - step_s - now)

    def record(self, seconds: float) -> None:
        self.held_s += seconds
