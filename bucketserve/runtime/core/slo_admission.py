"""SLO-aware admission: a new prompt waits while computing it would cost a running request
its TPOT target or an admitted prompt its TTFT target (torch-free)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from bucketserve.runtime.core.scheduler_output import SchedulerOutput
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.utils.moving_average import moving_average


class StepTimes:
    """Running estimates of what a step costs, from the steps the engine ran: the seconds of
    a step of decode rows alone, and the seconds each prompt token adds to a step.

    Exponential moving averages (weight `alpha` on the newest step), so they follow the
    batch size and the machine's load as they drift.
    """

    def __init__(self, alpha: float = 0.2, min_prefill_tokens: int = 32) -> None:
        self.alpha = alpha
        self.min_prefill_tokens = min_prefill_tokens  # fewer: too little signal in the step
        self.decode_s: float | None = None
        self.prefill_token_s: float | None = None

    @property
    def ready(self) -> bool:
        return self.decode_s is not None and self.prefill_token_s is not None

    def prime(self, decode_s: float, prefill_token_s: float) -> None:
        """Start from these (a probe's) where nothing is measured yet."""
        if self.decode_s is None:
            self.decode_s = decode_s
        if self.prefill_token_s is None:
            self.prefill_token_s = prefill_token_s

    def record(self, out: SchedulerOutput, seconds: float) -> None:
        prefill = sum(n for n in out.num_new_tokens if n > 1)
        if prefill == 0:
            self.decode_s = moving_average(self.decode_s, seconds, self.alpha)
        elif prefill >= self.min_prefill_tokens and self.decode_s is not None:
            per_token = max(0.0, seconds - self.decode_s) / prefill
            self.prefill_token_s = moving_average(self.prefill_token_s, per_token, self.alpha)


def tpot_slacks(
    running: Iterable[Sequence],
    now: float,
    decode_s: float,
    committed: float = 0.0,
    headroom: float = 0.0,
) -> list[tuple[float, int]]:
    """(seconds, tokens left) of each running sequence with a TPOT target that can still
    meet it: the seconds of its decode budget (`tpot_target x (max_tokens - 1)` from its
    first token, less `headroom`) its remaining decode steps (`decode_s` each) and the
    `committed` prefill seconds ahead leave over. One below 0 is lost already: left out."""
    slacks = []
    for seq in running:
        target, first = seq.tpot_target, seq.metrics.first_token_time
        if target is None or first is None:
            continue
        total = seq.sampling_params.max_tokens
        left = total - seq.num_output_tokens
        budget = (1 - headroom) * target * (total - 1)
        own = budget - (now - first) - left * decode_s - committed
        if own >= 0:
            slacks.append((own, left))
    return slacks


class SloAdmission:
    """Admits a new prompt only if every running sequence with a TPOT target can still meet
    it after paying for that prompt's prefill, and every admitted prompt its TTFT deadline.

    A running sequence's slack is its decode budget (`tpot_target x (max_tokens - 1)` from
    its first token, less `headroom` for what the estimates miss) less the time gone since
    its first token and the decode steps it still needs. Every prefill computed from now on
    delays every running sequence: the prompts already admitted and not yet computed, then
    the candidate. The admitted ones are computed whatever the candidate does, so a sequence
    their prefill alone breaks is lost already and holds nothing back (counted, it held
    prompts back for a target no wait could save). The candidate also adds a row to each
    decode step they share, priced as one prompt token (the same row through the same
    GEMMs). When that would break a running sequence's target, the candidate waits while
    its own TTFT deadline allows; at its last chance it goes in if it breaks only one (a
    sure first token for a likely miss).

    Nor may the candidate push an admitted prompt that can still make its TTFT deadline
    past it: prompts admitted together are computed in one step, so each one's first token
    waits for all of them, and a deadline missed by that wait alone is missed by a little.

    A prompt late by more than `late_yield_s` past its TTFT deadline is no longer held: it
    has yielded its bounded time (`WaitingQueue.peek`) and now starts as in plain queue
    order, so an overload's TTFT tail stays bounded too.

    A running sequence already past its budget is not protected, and a sequence that
    already streamed tokens (a preempted one resuming) is never held: its own TPOT is
    running. Until both step costs are measured, and with no running sequence that has a
    target (the offline engine), nothing is held.

    Past capacity this turns an overload that would make every running request miss its
    TPOT into prompts that wait; those past their TTFT deadline then yield to those still
    on time (`WaitingQueue`), so the SLOs lost are the overflow's.
    """

    def __init__(
        self,
        times: StepTimes | None = None,
        headroom: float = 0.05,
        late_yield_s: float | None = None,
    ) -> None:
        self.times = times or StepTimes()
        self.headroom = headroom  # of each target, kept for what the estimates miss
        self.late_yield_s = late_yield_s  # late by more: no longer held for running TPOTs
        self.num_holds = 0  # admissions held back, counted once per step that held one

    def lead_s(self, seq: Sequence, backlog: int = 0) -> float:
        """Seconds from admitting `seq` to its next token: a step, and the prefill of its
        prompt behind `backlog` prompt tokens admitted before it."""
        times = self.times
        if not times.ready:
            return 0.0
        assert times.decode_s is not None and times.prefill_token_s is not None
        return times.decode_s + (backlog + seq.num_uncomputed_tokens - 1) * times.prefill_token_s

    @staticmethod
    def backlog(running: Iterable[Sequence]) -> int:
        """Prompt tokens admitted and not computed yet."""
        return sum(seq.num_uncomputed_tokens - 1 for seq in running)  # a decoding row: 1

    def allows(
        self, candidate: Sequence, running: Collection[Sequence], now: float, backlog: int
    ) -> bool:
        """`backlog`: `backlog(running)`, which the caller has for `lead_s` already."""
        times = self.times
        if candidate.num_output_tokens or not times.ready:
            return True
        if self._held_enough(candidate, now):
            return self._admit_or_hold(self._keeps_first_tokens(candidate, running, now, backlog))
        assert times.decode_s is not None and times.prefill_token_s is not None
        committed = backlog * times.prefill_token_s  # computed whether or not this one waits
        slacks = tpot_slacks(running, now, times.decode_s, committed, self.headroom)
        prefill = candidate.num_uncomputed_tokens * times.prefill_token_s
        rows = candidate.sampling_params.max_tokens - 1  # the candidate's decode steps
        broken = sum(
            own < prefill + min(left, rows) * times.prefill_token_s for own, left in slacks
        )
        last_chance = broken == 1 and self._last_chance(candidate, backlog, now)
        return self._admit_or_hold(
            (broken == 0 or last_chance)
            and self._keeps_first_tokens(candidate, running, now, backlog)
        )

    def _held_enough(self, seq: Sequence, now: float) -> bool:
        """`seq` is no longer held for running TPOTs: it is late by more than
        `late_yield_s`."""
        y = self.late_yield_s
        if seq.ttft_deadline is None:
            return False
        return y is not None and seq.is_late(now - y)  # the overdue test of WaitingQueue.peek

    def _admit_or_hold(self, admit: bool) -> bool:
        if not admit:
            self.num_holds += 1
        return admit

    def _keeps_first_tokens(
        self, candidate: Sequence, running: Collection[Sequence], now: float, backlog: int
    ) -> bool:
        """No admitted prompt that can still make its TTFT deadline loses it to the
        candidate: prompts admitted together are computed in one step (up to the token
        budget), so each one's first token waits for the whole backlog, the candidate's
        tokens included."""
        times = self.times
        assert times.decode_s is not None and times.prefill_token_s is not None
        first_token = now + times.decode_s + backlog * times.prefill_token_s
        later = now + self.lead_s(candidate, backlog)
        return not any(
            seq.ttft_deadline is not None
            and not seq.num_output_tokens
            and first_token <= seq.ttft_deadline < later
            for seq in running
        )

    def _last_chance(self, seq: Sequence, backlog: int, now: float) -> bool:
        """`seq` meets its TTFT target only if it starts within about a step from now."""
        deadline, lead = seq.ttft_deadline, self.lead_s(seq, backlog)
        if deadline is None or now + lead > deadline:
            return False
        assert self.times.decode_s is not None
        return deadline - now - lead < 2 * self.times.decode_s
