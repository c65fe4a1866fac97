"""Hypothesis state machine over the Scheduler with up to three microbatches in flight:
random arrivals, aborts, tokens and landings keep the bookkeeping exact and always drain."""

from __future__ import annotations

from collections import deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bucketserve.runtime.core.block_manager import BlockManager
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from bucketserve.runtime.core.scheduler_output import SchedulerOutput
from bucketserve.runtime.core.sequence import Sequence, SequenceStatus

EOS = 2
NUM_BLOCKS = 8
BLOCK_SIZE = 4
MAX_SEQS = 4
DEPTH = 3


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        config = SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=12, watermark=0.1)
        self.s = Scheduler(config, self.bm, max_model_len=32, eos_token_ids=[EOS])
        self.flights: deque[SchedulerOutput] = deque()
        self.live: dict[int, Sequence] = {}
        self.next_id = 0

    @rule(length=st.integers(1, 20), max_tokens=st.integers(1, 16))
    def add(self, length: int, max_tokens: int):
        seq = Sequence([7] * length, SamplingParams(max_tokens=max_tokens), seq_id=self.next_id)
        self.next_id += 1
        self.s.add(seq)
        self.live[seq.seq_id] = seq

    @precondition(lambda self: len(self.flights) < DEPTH)
    @rule()
    def submit(self):
        out = self.s.schedule(max_seqs=2)
        before = [(s.num_computed_tokens, n) for s, n in zip(out.seqs, out.num_new_tokens,
                                                              strict=True)]
        for seq, (computed, n) in zip(out.seqs, before, strict=True):
            assert seq.status == SequenceStatus.RUNNING
            assert 1 <= n <= len(seq) - computed
            assert len(seq.block_table) * BLOCK_SIZE >= computed + n
        if out:
            self.flights.append(out)

    @precondition(lambda self: self.flights)
    @rule(eos=st.sampled_from([False, False, False, True]))
    def land(self, eos: bool):
        out = self.flights.popleft()
        tokens = [
            (EOS if eos else 5) if s.num_computed_tokens + n == len(s) else None
            for s, n in zip(out.seqs, out.num_new_tokens, strict=True)
        ]
        self.s.update(out, tokens)
        self.forget_finished()

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1000))
    def abort(self, pick: int):
        seq_id = sorted(self.live)[pick % len(self.live)]
        self.s.abort(seq_id)
        self.forget_finished()

    def forget_finished(self):
        self.live = {i: s for i, s in self.live.items() if not s.is_finished}

    @invariant()
    def microbatches_are_disjoint(self):
        ids = [s.seq_id for out in self.flights for s in out.seqs]
        assert len(ids) == len(set(ids))

    @invariant()
    def blocks_are_accounted_for(self):
        in_flight = {id(s): s for out in self.flights for s in out.seqs}
        holders = [s for s in self.live.values() if s.block_table]
        holders += [s for s in in_flight.values() if s.is_finished]  # aborted, not landed
        tables = [b for s in holders for b in s.block_table]
        assert len(tables) == len(set(tables))
        assert self.bm.num_free_blocks + len(tables) == NUM_BLOCKS
        assert len(self.s.running) <= MAX_SEQS
        for seq in self.s.waiting:
            assert seq.num_computed_tokens == 0 and not seq.block_table

    def teardown(self):
        steps = 0
        while self.flights or self.s.has_unfinished():
            if len(self.flights) < DEPTH:
                self.submit()
            if self.flights:
                self.land(eos=False)
            self.microbatches_are_disjoint()
            self.blocks_are_accounted_for()
            steps += 1
            assert steps < 1000, "the scheduler stopped making progress"
        assert self.bm.num_free_blocks == NUM_BLOCKS
        assert all(s.is_finished for s in self.live.values())


SchedulerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
TestSchedulerMachine = SchedulerMachine.TestCase
