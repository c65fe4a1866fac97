"""A simulated decode accelerator: the real Scheduler and BlockManager, stepped by the event
loop, with the cost model's step time in place of ModelRunner.execute."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as Sequence_

from benchmarks.simulator.cost_model import CostModel
from benchmarks.simulator.event_loop import EventLoop
from benchmarks.simulator.stage_clock import StageClock
from bucketserve.kv_transfer.lease import Lease, LeaseTable
from bucketserve.runtime.core.block_manager import BlockManager
from bucketserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from bucketserve.runtime.core.scheduler_output import SchedulerOutput
from bucketserve.runtime.core.sequence import Sequence

EOS = 2
TOKEN = 0
LEASE_TTL_S = 30.0  # never reached: a simulated transfer cannot fail


class DecodeWorker:
    """Continuous batching over a paged pool.

    With `commits_output` the pool's room is its blocks less every live
    sequence's full commitment (prompt + max_tokens), so admitted work never
    outgrows the pool; without it the room is the free list, and growth is
    met by the scheduler's preemption (recompute).

    Without commitments the Scheduler can deadlock: a preempted sequence at
    the head of `waiting` needs more free blocks than there are, while
    prefilled arrivals queued behind it hold theirs and nothing runs. The
    worker then recomputes the newest prefilled arrival (abort + add again
    with its tokens as the prompt) until the head fits, and counts it.

    With pipeline stages (`cost.pp` > 1) the worker is a stage group: it keeps
    up to pp disjoint microbatches of the running batch in flight, the next
    one scheduled as soon as the first stage hands the previous one on (the
    engine loop of the pipeline-parallel RFC).

    With `prefix_caching` the pool caches what its sequences computed; an incoming
    transfer takes the blocks already cached as they are (`reserve` with the prompts), so
    only the rest is shipped.

    A prompt sent to it unprefilled (`add_prompt`: conditional disaggregation's local path)
    is prefilled within its steps, as a colocated engine does; `on_first_token` tells when
    such a prompt has its first token.
    """

    def __init__(
        self,
        index: int,
        loop: EventLoop,
        cost: CostModel,
        num_blocks: int,
        block_size: int,
        scheduler_config: SchedulerConfig,
        commits_output: bool,
        on_finish: Callable[[Sequence, int, int], None],
        prefix_caching: bool = False,
    ) -> None:
        self.index = index
        self.loop = loop
        self.cost = cost
        self.block_manager = BlockManager(num_blocks, block_size, prefix_caching)
        self.cached_blocks: dict[str, list[int]] = {}  # lease -> each prompt's cached blocks
        self.leases = LeaseTable(
            f"decode{index}", lambda lease: self.block_manager.release(lease.flat_block_ids)
        )
        self.scheduler = Scheduler(
            scheduler_config, self.block_manager, cost.model.max_len, eos_token_ids=(EOS,)
        )
        self.commits_output = commits_output
        self.on_finish = on_finish
        self.committed = 0
        self.stages = StageClock(cost.pp, loop)
        self._microbatch_seqs = -(-scheduler_config.max_num_seqs // cost.pp)
        self.steps = 0
        self.recoveries = 0
        self.on_room_change: Callable[[DecodeWorker], None] = lambda worker: None
        self.on_first_token: Callable[[Sequence], None] = lambda seq: None
        self._prompts: set[int | str] = set()  # added unprefilled, no first token yet
        self._targets: dict[int | str, tuple[int, int]] = {}  # seq id -> (output len, commit)
        self._carried: dict[int | str, tuple[int, int]] = {}  # re-added: (tokens, preemptions)

    @property
    def busy(self) -> bool:
        return self.stages.in_flight > 0

    @property
    def busy_s(self) -> float:
        return self.stages.stage_busy_s / self.cost.pp

    @property
    def room(self) -> int:
        """Blocks a new batch may take: less the commitments, or (without them) less what the
        preempted sequences need to come back, so new arrivals cannot starve them."""
        bm = self.block_manager
        if self.commits_output:
            return bm.num_total_blocks - self.committed
        comeback = sum(
            bm.blocks_needed(len(s)) for s in self.scheduler.waiting if not s.block_table
        )
        return bm.num_free_blocks - comeback

    @property
    def load(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def can_reserve(self, prompt_lens: Sequence_[int]) -> bool:
        bm = self.block_manager
        return sum(bm.blocks_needed(n + 1) for n in prompt_lens) <= bm.num_free_blocks

    def reserve(
        self,
        request_ids: Sequence_[int],
        prompt_lens: Sequence_[int],
        commits: Sequence_[int],
        prompts: Sequence_[list[int]] | None = None,
    ) -> Lease:
        """Hold each prompt's blocks plus its first token's (what `add_prefilled` attaches)
        under one lease of the service's own lease table, and promise the commitments. With
        the `prompts`' tokens, the leading blocks the cache holds are taken as they are
        (`cached_blocks[lease_id]`: how many, per prompt)."""
        bm = self.block_manager
        prompts = prompts or [()] * len(prompt_lens)
        taken = [
            bm.reserve_prefix(tokens, bm.blocks_needed(n + 1))
            for tokens, n in zip(prompts, prompt_lens, strict=True)
        ]
        self.committed += sum(commits)
        ids = [str(i) for i in request_ids]
        lease = self.leases.open(ids, [b for b, _ in taken], LEASE_TTL_S, now=self.loop.now)
        self.cached_blocks[lease.lease_id] = [n for _, n in taken]
        self.on_room_change(self)
        return lease

    def land(self, lease_id: str) -> tuple[tuple[int, ...], ...]:
        """The batch's K/V arrived: close its lease; its blocks go on to the sequences."""
        self.cached_blocks.pop(lease_id, None)
        return self.leases.close(lease_id).block_ids

    def admit(self, seq: Sequence, block_ids: Sequence_[int], output_len: int, commit: int) -> None:
        """Take a prefilled sequence whose first token is already appended."""
        self._targets[seq.seq_id] = (output_len, commit)
        if self.scheduler.add_prefilled(seq, list(block_ids)):
            self._finished(seq)
        else:
            self._step()

    def add_prompt(self, seq: Sequence, output_len: int, commit: int) -> None:
        """Prefill `seq` here, within the decode steps, then decode it."""
        self._targets[seq.seq_id] = (output_len, commit)
        self.committed += commit
        self._prompts.add(seq.seq_id)
        self.scheduler.add(seq)
        self.on_room_change(self)
        self._step()

    @property
    def prompt_tokens_to_come(self) -> int:
        """Prompt tokens queued or in progress here, not yet computed."""
        s = self.scheduler
        return sum(
            q.num_uncomputed_tokens for q in (*s.waiting, *s.running) if q.num_uncomputed_tokens > 1
        )

    def output_tokens(self, seq: Sequence) -> int:
        """Tokens generated so far, counting those carried into a re-added sequence."""
        return seq.num_output_tokens + self._carried.get(seq.seq_id, (0, 0))[0]

    def preemptions(self, seq: Sequence) -> int:
        return seq.num_preemptions + self._carried.get(seq.seq_id, (0, 0))[1]

    def next_token(self, seq: Sequence) -> int:
        return EOS if self.output_tokens(seq) + 1 >= self._targets[seq.seq_id][0] else TOKEN

    def _step(self) -> None:
        if self.stages.full:
            return
        out = self.scheduler.schedule(self._microbatch_seqs)
        while not out.seqs and self._stalled():
            self._recover()
            out = self.scheduler.schedule(self._microbatch_seqs)
        if not out.seqs:
            return
        work = self._work(out)
        stage = self.cost.time(work)
        self.stages.start(stage)
        self.steps += 1
        self.loop.after(self.cost.pipeline_latency(work), self._done, out)
        if self.cost.pp > 1:  # the first stage takes the next microbatch
            self.loop.after(stage, self._step)

    def _stalled(self) -> bool:
        s = self.scheduler
        return bool(s.waiting) and not s.running and not self.block_manager.num_reserved_blocks

    def _recover(self) -> None:
        victim = next((s for s in reversed(self.scheduler.waiting) if s.block_table), None)
        if victim is None:
            raise RuntimeError(
                f"decode worker {self.index} stalled with nothing to recompute: "
                f"{len(self.scheduler.waiting)} waiting, {self.block_manager.num_free_blocks} free"
            )
        self.scheduler.abort(victim.seq_id)
        params = victim.sampling_params
        fresh = Sequence(
            list(victim.token_ids),
            dataclasses.replace(params, max_tokens=params.max_tokens - victim.num_output_tokens),
            seq_id=victim.seq_id,
            arrival_time=victim.arrival_time,
        )
        done, preempted = self._carried.get(victim.seq_id, (0, 0))
        self._carried[fresh.seq_id] = (
            done + victim.num_output_tokens,
            preempted + victim.num_preemptions + 1,
        )
        self.scheduler.add(fresh)
        self.recoveries += 1

    def _work(self, out: SchedulerOutput):
        if all(n == 1 for n in out.num_new_tokens):
            context = sum(s.num_computed_tokens for s in out.seqs)
            return self.cost.decode_work(len(out.seqs), context)
        return self.cost.work(out.num_new_tokens, [s.num_computed_tokens for s in out.seqs])

    def _done(self, out: SchedulerOutput) -> None:
        self.stages.finish()
        tokens = [
            self.next_token(s) if s.num_computed_tokens + n == len(s) else None
            for s, n in zip(out.seqs, out.num_new_tokens, strict=True)
        ]
        for seq in self.scheduler.update(out, tokens):
            if seq.seq_id in self._prompts:
                self._prompts.discard(seq.seq_id)
                self.on_first_token(seq)
            if seq.is_finished:
                self._finished(seq)
        if not self.commits_output:  # growth and preemption moved the free list
            self.on_room_change(self)
        self._step()

    def _finished(self, seq: Sequence) -> None:
        _, commit = self._targets.pop(seq.seq_id)
        self.committed -= commit
        self.on_room_change(self)
        self.on_finish(seq, self.output_tokens(seq), self.preemptions(seq))
        self._carried.pop(seq.seq_id, None)
