"""SLO-aware admission: step costs learned from steps, prompts held while a running request's
TPOT target needs the time, late-if-started-now ordering (no model needed)."""

from __future__ import annotations

import time

import pytest

from bucketserve.runtime.core.block_manager import BlockManager
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from bucketserve.runtime.core.scheduler_output import SchedulerOutput
from bucketserve.runtime.core.sequence import Sequence, SequenceStatus
from bucketserve.runtime.core.slo_admission import SloAdmission, StepTimes


def seq(name: str, n: int, max_tokens: int = 96, tpot: float | None = None) -> Sequence:
    s = Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), seq_id=name)
    s.tpot_target = tpot
    return s


def decoding(name: str, outputs: int, since_first_s: float, now: float, **kw) -> Sequence:
    """A running sequence `outputs` tokens in, its first token `since_first_s` ago."""
    s = seq(name, 8, **kw)
    s.token_ids.extend([5] * outputs)
    s.num_computed_tokens = len(s) - 1
    s.status = SequenceStatus.RUNNING
    s.metrics.first_token_time = now - since_first_s
    return s


def step(rows: list[int]) -> SchedulerOutput:
    out = SchedulerOutput()
    for i, n in enumerate(rows):
        out.add(seq(f"s{i}", max(n, 1)), n)
    return out


def admits(slo: SloAdmission, candidate: Sequence, running: list[Sequence], now: float) -> bool:
    return slo.allows(candidate, running, now, SloAdmission.backlog(running))


def times(decode_s: float = 0.1, prefill_token_s: float = 0.001) -> StepTimes:
    t = StepTimes()
    t.decode_s, t.prefill_token_s = decode_s, prefill_token_s
    return t


def test_step_times_separate_the_decode_step_from_the_cost_of_a_prompt_token():
    t = StepTimes(alpha=0.5)
    assert not t.ready
    t.record(step([1, 1, 1]), 0.10)
    assert t.decode_s == pytest.approx(0.10) and t.prefill_token_s is None
    t.record(step([1, 1, 200]), 0.30)  # 0.2 s over a decode step for 200 prompt tokens
    assert t.prefill_token_s == pytest.approx(0.001)
    t.record(step([1, 1, 1]), 0.20)
    assert t.decode_s == pytest.approx(0.15)  # halfway to the newest
    t.record(step([1, 1, 8]), 5.0)  # too few prompt tokens to learn from
    assert t.prefill_token_s == pytest.approx(0.001) and t.ready


def test_a_prompt_waits_only_when_its_prefill_would_break_a_running_target():
    now = time.monotonic()
    slo = SloAdmission(times(decode_s=0.1, prefill_token_s=0.001), headroom=0.0)
    # budget 0.25 x 95 = 23.75 s; 40 s gone would be lost anyway, so look at a tight one:
    # 10 outputs, 4 s since the first: slack 23.75 - 4 - 86 x 0.1 = 11.15 s
    roomy = decoding("roomy", 10, 4.0, now, tpot=0.25)
    assert admits(slo, seq("small", 400), [roomy], now)
    assert not admits(slo, seq("huge", 12_000), [roomy], now)  # 12 s of prefill > 11.15
    assert slo.num_holds == 1
    # 80 outputs, 17 s since the first: slack 23.75 - 17 - 16 x 0.1 = 5.15 s
    tight = decoding("tight", 80, 17.0, now, tpot=0.25)
    assert admits(slo, seq("p", 5_000), [roomy, tight], now)
    assert not admits(slo, seq("p", 5_300), [roomy, tight], now)
    # the candidate's decode row joins tight's 16 remaining steps at a prompt token's cost
    assert admits(slo, seq("p", 5_130), [roomy, tight], now)  # 5.13 + 0.016 < 5.15
    assert not admits(slo, seq("p", 5_135), [roomy, tight], now)  # 5.135 + 0.016
    assert admits(slo, seq("p", 5_135, max_tokens=1), [roomy, tight], now)  # no decode row
    # prompts admitted but not yet computed are paid from the same slack
    chunked = seq("chunked", 3_000)
    chunked.status = SequenceStatus.RUNNING
    assert not admits(slo, seq("p", 2_500), [roomy, tight, chunked], now)


def test_nothing_is_held_without_targets_measurements_or_a_target_to_save():
    now = time.monotonic()
    big = seq("big", 50_000)
    no_target = decoding("offline", 10, 1.0, now)
    assert admits(SloAdmission(times()), big, [no_target], now)
    tight = decoding("tight", 10, 1.0, now, tpot=0.25)
    assert admits(SloAdmission(StepTimes()), big, [tight], now)  # nothing measured yet
    assert not admits(SloAdmission(times()), big, [tight], now)
    lost = decoding("lost", 10, 30.0, now, tpot=0.25)  # past its budget already
    assert admits(SloAdmission(times()), big, [lost], now)
    resumed = seq("resumed", 50_000)
    resumed.token_ids.append(5)  # streamed a token before: its own TPOT is running
    assert admits(SloAdmission(times()), resumed, [tight], now)


def test_the_scheduler_holds_a_prompt_until_the_tight_request_ends():
    s = Scheduler(
        SchedulerConfig(watermark=0.0, max_num_batched_tokens=4096),
        BlockManager(512, 16),
        4096,
    )
    assert s.slo is not None
    s.slo.times.decode_s, s.slo.times.prefill_token_s = 0.1, 0.01
    tight = seq("tight", 8, max_tokens=3, tpot=0.25)
    s.add(tight)
    out = s.schedule()
    s.update(out, [5])  # first token: slack 0.9 x 0.25 x 2 - 2 x 0.1 = 0.25 s
    s.add(seq("long", 1_000))  # 10 s of prefill
    out = s.schedule()
    assert [x.seq_id for x in out.seqs] == ["tight"] and s.slo.num_holds == 1
    s.update(out, [5])
    out = s.schedule()
    assert [x.seq_id for x in out.seqs] == ["tight"]
    s.update(out, [5])  # its third token ends it
    out = s.schedule()
    assert [(x.seq_id, n) for x, n in zip(out.seqs, out.num_new_tokens, strict=True)] == [
        ("long", 1_000)
    ]


def test_without_slo_admission_the_prompt_joins_at_once():
    s = Scheduler(
        SchedulerConfig(watermark=0.0, max_num_batched_tokens=4096, slo_admission=False),
        BlockManager(512, 16),
        4096,
    )
    assert s.slo is None
    s.add(seq("tight", 8, max_tokens=3, tpot=0.25))
    s.update(s.schedule(), [5])
    s.add(seq("long", 1_000))
    assert [x.seq_id for x in s.schedule().seqs] == ["tight", "long"]


def test_a_prompt_that_cannot_make_its_deadline_if_started_now_yields():
    s = Scheduler(SchedulerConfig(watermark=0.0), BlockManager(512, 16), 4096)
    assert s.slo is not None
    s.slo.times.decode_s, s.slo.times.prefill_token_s = 0.1, 0.01
    now = time.monotonic()
    doomed, fine = seq("doomed", 300), seq("fine", 10)
    doomed.ttft_deadline = now + 2.0  # needs 0.1 + 299 x 0.01 = 3.09 s
    fine.ttft_deadline = now + 2.0  # needs 0.19 s
    s.add(doomed)
    s.add(fine)
    assert s.waiting.peek(now, s.slo.lead_s) is fine
    assert s.waiting.peek(now) is doomed  # without lead times: queue order
    # behind 200 prompt tokens admitted first, neither makes it: the front goes first
    assert s.waiting.peek(now, lambda q, ahead: s.slo.lead_s(q, 200 + ahead)) is doomed


def test_a_prompt_waits_rather_than_push_an_admitted_one_past_its_first_token_deadline():
    now = time.monotonic()
    slo = SloAdmission(times(decode_s=0.1, prefill_token_s=0.001))
    admitted = seq("admitted", 500)  # admitted, not computed: first token at now + 0.1 + 0.499
    admitted.status = SequenceStatus.RUNNING
    admitted.ttft_deadline = now + 0.9
    # the candidate's lead: 0.1 + (499 + its tokens - 1) x 0.001
    assert admits(slo, seq("fits", 301), [admitted], now)  # the step ends at now + 0.899
    assert not admits(slo, seq("too_big", 303), [admitted], now)  # now + 0.901
    assert slo.num_holds == 1
    admitted.ttft_deadline = now + 0.5  # lost whatever waits: not protected
    assert admits(slo, seq("too_big", 303), [admitted], now)
    admitted.ttft_deadline = now + 0.9
    admitted.token_ids.append(5)  # its first token is out
    assert admits(slo, seq("too_big", 303), [admitted], now)


def test_a_sequence_the_admitted_prompts_already_break_holds_nothing_back():
    now = time.monotonic()
    slo = SloAdmission(times(decode_s=0.1, prefill_token_s=0.001), headroom=0.0)
    # 80 outputs, 17 s since the first: slack 23.75 - 17 - 16 x 0.1 = 5.15 s
    tight = decoding("tight", 80, 17.0, now, tpot=0.25)
    admitted = seq("admitted", 6_001)  # 6 s of prefill admitted: tight's target is lost
    admitted.status = SequenceStatus.RUNNING
    assert admits(slo, seq("p", 2_000), [tight, admitted], now)
    # with 5 s admitted, 0.15 s are left: the candidate's 0.2 s would break it
    admitted.token_ids = admitted.token_ids[:5_001]
    assert not admits(slo, seq("p", 200), [tight, admitted], now)
    assert admits(slo, seq("p", 100, max_tokens=1), [tight, admitted], now)


def test_a_prompt_late_by_more_than_late_yield_s_is_no_longer_held_for_running_targets():
    now = time.monotonic()
    slo = SloAdmission(times(), late_yield_s=8.0)
    tight = decoding("tight", 10, 1.0, now, tpot=0.25)
    late, overdue = seq("late", 50_000), seq("overdue", 50_000)
    late.ttft_deadline, overdue.ttft_deadline = now - 7.0, now - 9.0
    assert not admits(slo, late, [tight], now)  # 7 s past: still yields its TPOT target
    assert admits(slo, overdue, [tight], now)
    assert not admits(SloAdmission(times()), overdue, [tight], now)  # no bound: held
    # it still waits a step rather than push an admitted prompt past its first token
    admitted = seq("admitted", 500)
    admitted.status = SequenceStatus.RUNNING
    admitted.ttft_deadline = now + 0.9
    assert not admits(slo, overdue, [tight, admitted], now)
    assert slo.num_holds == 2
