"""Scheduler bookkeeping, driven step by step with chosen tokens (no model needed)."""

from __future__ import annotations

import time

import pytest

from bucketserve.runtime.core.block_manager import BlockManager
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from bucketserve.runtime.core.scheduler_output import SchedulerOutput
from bucketserve.runtime.core.sequence import FinishReason, Priority, Sequence, SequenceStatus

EOS = 2


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 256,
    **config,
) -> Scheduler:
    config = {"watermark": 0.0, **config}
    return Scheduler(
        SchedulerConfig(**config),
        BlockManager(num_blocks, block_size),
        max_model_len,
        eos_token_ids=[EOS],
    )


def seq(name: str, n: int, **params) -> Sequence:
    return Sequence([10 + i for i in range(n)], SamplingParams(**params), seq_id=name)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq_id, n) for s, n in zip(out.seqs, out.num_new_tokens, strict=True)]


def run(s: Scheduler, token: int = 5) -> list[tuple[str, int]]:
    """One synchronous step where every sampled token is `token`."""
    out = s.schedule()
    s.update(out, [token if n == s_.num_uncomputed_tokens else None
                   for s_, n in zip(out.seqs, out.num_new_tokens, strict=True)])
    return plan(out)


def test_running_limit_and_fcfs_admission():
    s = make(max_num_seqs=2)
    for name in "abc":
        s.add(seq(name, 3, max_tokens=2))
    assert run(s) == [("a", 3), ("b", 3)]  # c waits for a slot
    assert run(s) == [("a", 1), ("b", 1)]  # both finish on their 2nd token
    assert run(s) == [("c", 3)]  # c joins as soon as they leave
    assert run(s) == [("c", 1)]
    assert not s.has_unfinished()
    assert s.block_manager.num_free_blocks == 64


def test_token_budget_chunks_prefill_after_decodes():
    s = make(max_num_batched_tokens=8)
    s.add(seq("a", 4, max_tokens=5))
    assert run(s) == [("a", 4)]
    s.add(seq("b", 20, max_tokens=5))
    s.add(seq("c", 2, max_tokens=5))
    # decode rows first, then b's prompt in chunks; c waits behind b (FCFS)
    assert run(s) == [("a", 1), ("b", 7)]
    assert run(s) == [("a", 1), ("b", 7)]
    assert run(s) == [("a", 1), ("b", 6), ("c", 1)]
    b = s.get("b")
    assert b.num_output_tokens == 1 and b.num_computed_tokens == 20
    assert run(s) == [("a", 1), ("b", 1), ("c", 1)]


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    s = make(num_blocks=80, max_num_batched_tokens=256, enable_chunked_prefill=False)
    s.add(seq("a", 6, max_tokens=3))
    s.add(seq("b", 251, max_tokens=1))
    assert run(s) == [("a", 6)]  # b (251) does not fit next to a's prompt
    assert run(s) == [("a", 1), ("b", 251)]


def test_no_chunking_needs_a_budget_for_the_longest_sequence():
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 256"):
        make(max_num_batched_tokens=100, enable_chunked_prefill=False)


def test_a_long_prompt_computes_in_chunks_of_the_threshold_and_short_ones_start_beside_it():
    s = make(long_prefill_token_threshold=8)
    s.add(seq("long", 20, max_tokens=3))
    assert run(s) == [("long", 8)]  # not the whole budget
    s.add(seq("short", 5, max_tokens=3))  # arrives mid-prompt: waits for a chunk only
    assert run(s) == [("long", 8), ("short", 5)]
    assert run(s) == [("long", 4), ("short", 1)]  # the last chunk samples
    assert s.get("long").num_output_tokens == 1


def test_one_long_prompt_at_a_time_until_it_has_its_first_token():
    s = make(long_prefill_token_threshold=8)
    for name in ("first", "second"):
        s.add(seq(name, 12, max_tokens=2))
    s.add(seq("short", 3, max_tokens=2))
    # second is long too: it keeps its place while short passes it
    assert run(s) == [("first", 8), ("short", 3)]
    # first's last chunk still holds the place: second would lengthen the step it ends in
    assert run(s) == [("first", 4), ("short", 1)]
    assert run(s) == [("first", 1), ("second", 8)]
    assert run(s) == [("second", 4)]


def test_more_long_prompts_at_once_when_allowed_and_none_when_off():
    s = make(long_prefill_token_threshold=8, max_long_partial_prefills=2)
    for name in ("a", "b", "c"):
        s.add(seq(name, 12, max_tokens=2))
    assert run(s) == [("a", 8), ("b", 8)]
    off = make(max_num_batched_tokens=30)
    for name in ("a", "b", "c"):
        off.add(seq(name, 12, max_tokens=2))
    assert run(off) == [("a", 12), ("b", 12), ("c", 6)]
    whole = make(max_num_batched_tokens=256, enable_chunked_prefill=False,
                 long_prefill_token_threshold=8)  # no chunks without chunked prefill
    for name in ("a", "b"):
        whole.add(seq(name, 12, max_tokens=2))
    assert run(whole) == [("a", 12), ("b", 12)]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_the_long_prefill_threshold_is_a_count_of_tokens(bad):
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold\n  Input should be"):
        make(long_prefill_token_threshold=bad)
    with pytest.raises(ValueError, match=r"max_long_partial_prefills\n  Input should be greater"):
        make(max_long_partial_prefills=0)


def test_a_prompt_waiting_for_a_prefix_in_flight_lets_the_ones_behind_it_start():
    s = Scheduler(SchedulerConfig(watermark=0.0), BlockManager(64, 4, enable_prefix_caching=True),
                  256, eos_token_ids=[EOS])
    s.add(seq("first", 10, max_tokens=2))
    first = s.schedule()  # first's blocks are named, its step not run yet
    s.add(seq("same_prefix", 10, max_tokens=2))
    s.add(Sequence([70, 71, 72], SamplingParams(max_tokens=2), seq_id="other"))
    # "other" starts; "same_prefix" keeps its place and finds the prefix cached next step
    assert plan(s.schedule(max_seqs=4)) == [("other", 3)]
    assert [q.seq_id for q in s.waiting] == ["same_prefix"]
    s.update(first, [5])
    nxt = s.schedule()
    assert ("same_prefix", 2) in plan(nxt)  # 8 of its 10 tokens were cached


def test_preemption_takes_the_newest_and_it_resumes_with_its_tokens():
    s = make(num_blocks=4, block_size=4)
    s.add(seq("old", 4, max_tokens=10))
    s.add(seq("new", 4, max_tokens=10))
    assert run(s) == [("old", 4), ("new", 4)]  # 2 blocks each, full pool
    for _ in range(4):  # up to 9 tokens each: the 9th has no slot yet
        assert run(s) == [("old", 1), ("new", 1)]
    new = s.get("new")
    tokens = list(new.token_ids)
    assert run(s) == [("old", 1)]  # old needs a 3rd block: new is preempted
    assert s.num_preemptions == 1 and new.num_preemptions == 1
    assert new.status == SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert new.block_table == [] and new.token_ids == tokens  # output kept
    assert list(s.waiting) == [new]
    while s.get("old") is not None:
        run(s)
    assert run(s) == [("new", 9)]  # recomputes prompt + its 5 generated tokens
    assert new.num_output_tokens == 6


def prio(name: str, n: int, priority: Priority, arrival: float, **params) -> Sequence:
    return Sequence(
        [10 + i for i in range(n)], SamplingParams(**params), seq_id=name, arrival_time=arrival,
        priority=priority,
    )


def test_priority_policy_admits_the_lowest_priority_value_first_then_by_arrival():
    s = make(max_num_seqs=2, scheduling_policy="priority")
    s.add(prio("batch-early", 3, 1, arrival=1.0, max_tokens=1))
    s.add(prio("chat-late", 3, 0, arrival=3.0, max_tokens=1))
    s.add(prio("chat-early", 3, 0, arrival=2.0, max_tokens=1))
    s.add(prio("urgent", 3, -1, arrival=4.0, max_tokens=1))
    assert [q.seq_id for q in s.waiting] == ["urgent", "chat-early", "chat-late", "batch-early"]
    assert run(s) == [("urgent", 3), ("chat-early", 3)]
    assert run(s) == [("chat-late", 3), ("batch-early", 3)]
    assert not s.has_unfinished() and s.block_manager.num_free_blocks == 64


def test_fcfs_policy_ignores_priority():
    s = make(max_num_seqs=1)
    s.add(prio("low", 3, 5, arrival=1.0, max_tokens=1))
    s.add(prio("high", 3, 0, arrival=2.0, max_tokens=1))
    assert run(s) == [("low", 3)]
    assert run(s) == [("high", 3)]


def test_priority_policy_preempts_the_lowest_priority_and_requeues_it_by_its_arrival():
    s = make(num_blocks=4, block_size=4, scheduling_policy="priority")
    s.add(prio("chat", 4, 0, arrival=2.0, max_tokens=10))
    s.add(prio("batch", 4, 1, arrival=1.0, max_tokens=10))
    assert run(s) == [("chat", 4), ("batch", 4)]  # priority first: chat joined first
    for _ in range(4):
        assert run(s) == [("chat", 1), ("batch", 1)]
    assert run(s) == [("chat", 1)]  # both need a 3rd block: the low-priority one goes
    batch = s.get("batch")
    assert batch.status == SequenceStatus.WAITING and s.num_preemptions == 1
    s.add(prio("later", 2, 1, arrival=9.0, max_tokens=1))
    assert [q.seq_id for q in s.waiting] == ["batch", "later"]  # its arrival keeps its place


def test_a_requests_own_priority_ranks_it_only_among_its_tenants_requests():
    """The service's (tenant, request) pairs: a batch tenant's request with the most urgent
    own priority still waits behind the chat tenant's, and is the one preempted."""
    s = make(num_blocks=4, block_size=4, max_num_seqs=2, scheduling_policy="priority")
    s.add(prio("batch-pushy", 4, (1, -1_000_000), arrival=1.0, max_tokens=10))
    s.add(prio("chat", 4, (0, 5), arrival=2.0, max_tokens=10))
    s.add(prio("batch-calm", 4, (1, 0), arrival=0.5, max_tokens=10))
    assert [q.seq_id for q in s.waiting] == ["chat", "batch-pushy", "batch-calm"]
    assert run(s) == [("chat", 4), ("batch-pushy", 4)]
    for _ in range(4):
        assert run(s) == [("chat", 1), ("batch-pushy", 1)]
    assert run(s) == [("chat", 1)]  # both need a 3rd block: the batch tenant's goes
    assert s.get("batch-pushy").status == SequenceStatus.WAITING and s.num_preemptions == 1


def due(name: str, deadline: float | None, priority: int = 0) -> Sequence:
    seq = prio(name, 3, priority, arrival=0.0, max_tokens=2)
    seq.ttft_deadline = deadline
    return seq


def timed(s: Scheduler, decode_s: float = 0.1, prefill_token_s: float = 1.0) -> Scheduler:
    """`s` with its step costs known: a 3-token prompt's first token comes 2.1 s after it
    starts, 5.1 s when another such prompt is computed first."""
    assert s.slo is not None
    s.slo.times.decode_s, s.slo.times.prefill_token_s = decode_s, prefill_token_s
    return s


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_late_request_yields_to_one_it_would_make_late(policy):
    """The first in line is late; the one behind it makes its deadline only if it starts
    first, so it does, and the late one runs as soon as room allows."""
    now = time.monotonic()
    s = timed(make(max_num_seqs=1, scheduling_policy=policy))
    for q in (due("late", now - 1), due("on-time", now + 3.5), due("no-target", None)):
        s.add(q)
    assert not s.get("on-time").is_late(now + 2.1) and s.get("on-time").is_late(now + 5.1)
    assert run(s) == [("on-time", 3)]
    assert run(s) == [("on-time", 1)]
    assert run(s) == [("late", 3)]  # nothing behind it has a deadline to lose
    assert run(s) == [("late", 1)]
    assert run(s) == [("no-target", 3)]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_late_request_keeps_its_place_when_those_behind_can_spare_the_time(policy):
    now = time.monotonic()
    s = timed(make(max_num_seqs=1, scheduling_policy=policy))
    for q in (due("late", now - 1), due("on-time", now + 60)):
        s.add(q)
    assert [run(s)[0][0] for _ in range(4)] == ["late", "late", "on-time", "on-time"]


def test_until_step_costs_are_known_a_late_request_keeps_its_place():
    now = time.monotonic()
    s = make(max_num_seqs=1)
    for q in (due("late", now - 1), due("on-time", now + 1)):
        s.add(q)
    assert [run(s)[0][0] for _ in range(4)] == ["late", "late", "on-time", "on-time"]


def test_without_slo_admission_a_late_request_keeps_its_place():
    now = time.monotonic()
    s = make(max_num_seqs=1, slo_admission=False)
    for q in (due("late", now - 1), due("on-time", now + 60)):
        s.add(q)
    assert [run(s)[0][0] for _ in range(4)] == ["late", "late", "on-time", "on-time"]


def test_a_request_late_by_more_than_late_yield_s_takes_its_place_back():
    now = time.monotonic()
    s = timed(make(max_num_seqs=1, late_yield_s=5.0))
    for q in (due("late", now - 1), due("overdue", now - 60), due("on-time", now + 6.5)):
        s.add(q)
    # "overdue" has waited long enough and keeps its place; "on-time" makes its deadline
    # behind it (5.1 s), not behind "late" as well (8.1 s), so "late" (1 s past its
    # deadline, under 5 s) yields; once "overdue" is done, "on-time" can spare the time
    order = [run(s)[0][0] for _ in range(6)]
    assert order == ["overdue", "overdue", "late", "late", "on-time", "on-time"]


@pytest.mark.parametrize("bad", [0, -1.0, True, "5"])
def test_late_yield_s_must_be_positive_seconds(bad):
    with pytest.raises(ValueError, match=r"late_yield_s\n  Input should be"):
        SchedulerConfig(late_yield_s=bad)


def test_only_late_requests_keep_their_order_and_priority_still_comes_first():
    now = time.monotonic()
    s = make(max_num_seqs=1, scheduling_policy="priority")
    for q in (due("late-a", now - 1), due("late-b", now - 2), due("batch", now + 60, 1)):
        s.add(q)
    order = [run(s)[0][0] for _ in range(6)]
    # all of priority 0 are late: arrival order; the on-time one of priority 1 still waits
    assert order == ["late-a", "late-a", "late-b", "late-b", "batch", "batch"]


def test_a_request_past_its_deadline_is_not_late_once_it_has_a_token():
    seq = due("r", time.monotonic() - 1)
    assert seq.is_late(time.monotonic())
    seq.append_token(7)
    assert not seq.is_late(time.monotonic())


def test_scheduling_policy_must_be_known():
    with pytest.raises(ValueError, match=r"scheduling_policy\n  Input should be 'fcfs' or 'p"):
        SchedulerConfig(scheduling_policy="sjf")


def test_the_newest_preempts_itself_when_older_ones_were_scheduled_first():
    s = make(num_blocks=4, block_size=4)
    s.add(seq("old", 7, max_tokens=10))
    s.add(seq("new", 8, max_tokens=10))
    assert run(s) == [("old", 7), ("new", 8)]  # 8 and 9 tokens: only new needs a 3rd block
    assert run(s) == [("old", 1)]  # new gave its blocks up rather than waiting on them
    assert s.get("new").status == SequenceStatus.WAITING and s.num_preemptions == 1
    assert s.block_manager.num_free_blocks == 2


def test_a_lone_sequence_that_outgrows_the_pool_preempts_itself_never():
    s = make(num_blocks=2, block_size=4)  # the pool holds 8 tokens: that is the length cap
    a = seq("a", 5, max_tokens=100)
    s.add(a)
    while s.has_unfinished():
        run(s)
    assert a.finish_reason == FinishReason.LENGTH and len(a) == 8
    assert s.num_preemptions == 0 and s.block_manager.num_free_blocks == 2


def test_in_flight_sequences_are_not_scheduled_twice():
    s = make()
    s.add(seq("a", 3, max_tokens=4))
    first = s.schedule()
    assert plan(first) == [("a", 3)]
    s.add(seq("b", 2, max_tokens=4))
    second = s.schedule()  # a is still in flight
    assert plan(second) == [("b", 2)]
    assert plan(s.schedule()) == []
    s.update(first, [7])
    s.update(second, [8])
    s.add(seq("c", 2, max_tokens=4))
    assert plan(s.schedule(max_seqs=2)) == [("a", 1), ("b", 1)]  # a microbatch's share
    assert plan(s.schedule(max_seqs=2)) == [("c", 2)]
    assert s.get("a").token_ids[-1] == 7 and s.get("b").token_ids[-1] == 8


def test_preemption_skips_in_flight_sequences():
    s = make(num_blocks=5, block_size=4)
    s.add(seq("a", 8, max_tokens=10))
    s.add(seq("b", 3, max_tokens=10))
    first = s.schedule()
    s.add(seq("c", 8, max_tokens=10))
    second = s.schedule()
    assert plan(second) == [("c", 8)] and s.block_manager.num_free_blocks == 0
    s.update(first, [5, 5])  # a (9 tokens) needs a 3rd block
    third = s.schedule()
    assert plan(third) == [("a", 1)]  # b, not c (in flight), was preempted
    assert s.num_preemptions == 1
    assert s.get("b").status == SequenceStatus.WAITING
    assert s.get("c").status == SequenceStatus.RUNNING
    s.update(second, [5])
    s.update(third, [5])
    while s.has_unfinished():
        run(s)
    assert s.block_manager.num_free_blocks == 5


def test_newest_in_flight_blocks_self_preemption():
    s = make(num_blocks=4, block_size=4)
    s.add(seq("a", 8, max_tokens=10))
    a_flight = s.schedule()
    s.add(seq("b", 8, max_tokens=10))
    b_flight = s.schedule()
    assert plan(a_flight) == [("a", 8)] and plan(b_flight) == [("b", 8)]
    s.update(a_flight, [5])  # a needs a 3rd block; b, the newest, is in flight
    assert plan(s.schedule()) == []  # a waits instead of preempting itself
    assert s.num_preemptions == 0
    s.update(b_flight, [5])
    assert run(s) == [("a", 1)]  # now b can be preempted
    assert s.num_preemptions == 1 and s.get("b").status == SequenceStatus.WAITING
    while s.has_unfinished():
        run(s)
    assert s.block_manager.num_free_blocks == 4


def test_stop_conditions():
    s = make(max_model_len=12)
    s.add(seq("eos", 3, max_tokens=10))
    s.add(seq("ignore", 3, max_tokens=3, ignore_eos=True))
    s.add(seq("stop_id", 3, max_tokens=10, stop_token_ids=[9]))
    s.add(seq("model_len", 9, max_tokens=10))
    out = s.schedule()
    s.update(out, [EOS, EOS, 9, 4])
    eos, ignore, stop_id, model_len = out.seqs
    assert (eos.finish_reason, eos.stop_reason) == (FinishReason.STOP, None)
    assert (stop_id.finish_reason, stop_id.stop_reason) == (FinishReason.STOP, 9)
    assert not ignore.is_finished and not model_len.is_finished
    run(s, EOS)
    run(s, EOS)
    assert ignore.finish_reason == FinishReason.LENGTH and ignore.output_token_ids == [EOS] * 3
    assert model_len.finish_reason == FinishReason.STOP  # EOS on its 2nd token
    assert s.block_manager.num_free_blocks == 64 and not s.has_unfinished()


def test_max_model_len_finishes_with_length():
    s = make(max_model_len=12)
    a = seq("a", 9, max_tokens=10)
    s.add(a)
    while s.has_unfinished():
        run(s)
    assert a.finish_reason == FinishReason.LENGTH and len(a) == 12


def test_prompts_that_can_never_fit_are_rejected_at_add():
    s = make(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match=r"16 prompt tokens .* within 16 .*KV pool of 4 blocks"):
        s.add(seq("big", 16))
    s2 = make(max_model_len=10)
    with pytest.raises(ValueError, match="max_model_len 10"):
        s2.add(seq("long", 10))
    s2.add(seq("ok", 9))
    with pytest.raises(ValueError, match="already scheduled"):
        s2.add(seq("ok", 3))
    assert [q.seq_id for q in s2.waiting] == ["ok"] and not s.has_unfinished()


def test_abort_frees_blocks_at_once_unless_in_flight():
    s = make(max_num_seqs=2)
    s.add(seq("a", 6, max_tokens=10))
    s.add(seq("b", 6, max_tokens=10))
    s.add(seq("w", 6, max_tokens=10))
    run(s)
    a = s.abort("a")
    assert a.finish_reason == FinishReason.CANCELLED and a.block_table == []
    assert s.block_manager.num_free_blocks == 64 - 2
    s.abort("w")  # a waiting one
    flight = s.schedule()
    assert plan(flight) == [("b", 1)]
    b = s.abort("b")
    assert b.block_table and s.block_manager.num_free_blocks == 64 - 2  # freed on landing
    assert s.update(flight, [5]) == []
    assert b.block_table == [] and s.block_manager.num_free_blocks == 64
    assert b.output_token_ids == [5]  # the token of the aborted flight is dropped
    with pytest.raises(KeyError):
        s.abort("b")


def test_prefilled_arrival_joins_running_and_can_end_on_its_first_token():
    s = make(num_blocks=8, block_size=4)
    blocks = s.block_manager.reserve(2)
    arrived = seq("p", 8, max_tokens=3)
    arrived.append_token(42)
    arrived.num_computed_tokens = 8
    assert s.add_prefilled(arrived, blocks) is False
    assert arrived.block_table == blocks and arrived.metrics.first_token_time is not None
    assert run(s) == [("p", 1)]  # the first token's K/V; a 3rd block for its slot
    assert len(arrived.block_table) == 3
    while s.has_unfinished():
        run(s)
    assert arrived.output_token_ids == [42, 5, 5]
    done = seq("q", 4, max_tokens=1)
    done.append_token(7)
    done.num_computed_tokens = 4
    assert s.add_prefilled(done, s.block_manager.reserve(1)) is True
    assert done.finish_reason == FinishReason.LENGTH
    assert s.block_manager.num_free_blocks == 8 and s.block_manager.num_reserved_blocks == 0


def test_prefilled_arrival_must_have_exactly_its_first_token():
    s = make()
    blocks = s.block_manager.reserve(2)
    bad = seq("p", 8)
    with pytest.raises(ValueError, match="exactly one output token"):
        s.add_prefilled(bad, blocks)
    assert s.block_manager.num_reserved_blocks == 2 and not s.has_unfinished()
