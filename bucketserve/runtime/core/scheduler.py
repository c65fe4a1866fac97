"""Continuous batching over a paged KV pool (torch-free)."""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from typing import Annotated, Literal

from annotated_types import Gt, Le
from pydantic import Field

from bucketserve.runtime.core.block_manager import BlockManager
from bucketserve.runtime.core.scheduler_output import SchedulerOutput
from bucketserve.runtime.core.sequence import FinishReason, Sequence, SequenceStatus, finish_reason
from bucketserve.runtime.core.slo_admission import SloAdmission, StepTimes
from bucketserve.runtime.core.virtual_token_counter import VirtualTokenCounter
from bucketserve.runtime.core.waiting_queue import WaitingQueue
from bucketserve.utils.settings import Settings


class SchedulerConfig(Settings):
    """A decode engine's continuous batching (the config file's `controller.decode` keys; the
    offline `LLM` takes them as keywords). With chunked prefill a prompt longer than the
    step's leftover budget is computed over several steps. On a CPU a prefill chunk of a few
    hundred tokens already runs its GEMMs near the cores' peak, so batching two long prompts
    together gains little and holds back the first's first token and everything queued
    behind both; under a burst of long prompts the smaller steps cost some TTFT
    (`docs/performance.md`). `slo_admission` is `bucketserve.runtime.core.slo_admission`;
    a prompt past its TTFT deadline yields in `WaitingQueue.peek`."""

    max_num_seqs: int = Field(64, ge=1)
    """Sequences in one decode batch."""
    max_num_batched_tokens: int = Field(2048, ge=1)
    """Tokens of one engine step."""
    enable_chunked_prefill: bool = True
    """Prefill a long prompt over several steps (the colocated topology, and recomputing a
    preempted sequence)."""
    long_prefill_token_threshold: int = Field(0, ge=0)
    """A prompt with more tokens than this left to compute is long: it computes at most
    this many a step, so a short prompt arriving meanwhile waits for a chunk, not the
    whole prompt (vLLM's knob, off there by default); 0: off, as in the offline `LLM`."""
    max_long_partial_prefills: int = Field(1, ge=1)
    """Long prompts in progress at once; the next starts when one has its first token,
    while shorter prompts start beside them."""
    watermark: float = Field(0.01, ge=0, lt=1)
    """Share of the KV blocks kept free before admitting more."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """fcfs, or priority: by tenant priority, then request priority (lowest first, then
    arrival; under memory pressure the lowest-priority running sequence is preempted
    first), as vLLM's."""
    slo_admission: bool = True
    """A new prompt waits while its prefill would cost a running request its TPOT target,
    and one past its TTFT deadline yields to those on time it would make late; false:
    plain queue order, as vLLM's."""
    late_yield_s: float | None = Field(None, gt=0)
    """Seconds past its TTFT deadline a prompt yields (and is held for running TPOTs)
    before it takes its place back; null: no bound."""
    pipeline_depth: int = Field(1, ge=1)
    """Microbatches in flight (1: synchronous schedule / submit / finish / update)."""
    cache_shares: dict[str, Annotated[float, Gt(0), Le(1)]] | None = Field(None, exclude=True)
    """Tenant name -> the fraction of the evictable cached blocks it may hold while others
    want room (`BlockManager`); tenants not named are not bounded. Set from the tenants."""


class Scheduler:
    """Waiting and running queues; decides each step's microbatch and applies its results.

    Parallel samples of one prompt (`forks`) wait until their parent has computed
    the prompt, then share its full prompt blocks (reference counts) and recompute
    only the tail from the last full block on, into blocks of their own, which
    samples their first token; they then run as any other sequence.

    A step schedules running sequences first (one decode token each, or the
    next chunk of a prompt), then admits waiting ones in queue order while the
    running limit, the token budget and the free blocks allow (under SLO admission a
    waiting sequence past its TTFT deadline goes after those of its priority still on
    time that it would make late). A sequence in an in-flight microbatch is never
    scheduled again until `update` has seen that microbatch. When a sequence needs a
    block and none is free, the newest running sequence (under the priority policy: of
    the lowest priority) is preempted by recompute: its blocks are freed, it keeps its
    tokens, and it goes back to the waiting queue (FCFS: to its front).

    Under the priority policy tenants share the engine by their weights: a virtual token
    counter (`fair`) charges each tenant the prompt and output tokens it is served, and
    among tenants of one tenant priority the waiting queue admits the least served first
    and preemption takes from the most served.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: Collection[int] = (),
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        capacity = block_manager.num_total_blocks * block_manager.block_size
        self.max_seq_len = min(max_model_len, capacity)  # prompt + output never exceed this
        self._length_limits = (
            f"max_model_len {max_model_len}, KV pool of {block_manager.num_total_blocks} "
            f"blocks x {block_manager.block_size} tokens"
        )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_seq_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens must be >= {self.max_seq_len} "
                f"({self._length_limits}), got {config.max_num_batched_tokens}"
            )
        self.eos_token_ids = frozenset(eos_token_ids)
        self.fair = VirtualTokenCounter()
        self.waiting = WaitingQueue(config.scheduling_policy, self.fair)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._seqs: dict[int | str, Sequence] = {}
        self._forks: dict[int | str, list[Sequence]] = {}  # parent id -> samples waiting for it
        self._in_flight: set[int | str] = set()
        self._watermark_blocks = int(config.watermark * block_manager.num_total_blocks)
        # chunks need chunked prefill; without it every prompt runs whole
        self._long_threshold = (
            config.long_prefill_token_threshold if config.enable_chunked_prefill else 0
        )
        # what steps cost, learned from those run: SLO-aware admission and decode pacing
        self.step_times = StepTimes()
        self.slo = (
            SloAdmission(self.step_times, late_yield_s=config.late_yield_s)
            if config.slo_admission
            else None
        )

    # -- admission ---------------------------------------------------------------------------

    def add(self, seq: Sequence, forks: Collection[Sequence] = ()) -> None:
        """Queue a new sequence, or one resuming with outputs it streamed elsewhere (they are
        prefilled with the prompt); raises ValueError (changing nothing) if it can never run.
        `forks`: further samples of its prompt, started once `seq` has computed it."""
        self.check(seq)
        self._check_forks(seq, forks)
        self._seqs[seq.seq_id] = seq
        self._register_forks(seq, forks)
        self._backlog(seq)
        self.waiting.push(seq)

    def _backlog(self, seq: Sequence) -> None:
        """`seq` joins the queue: its tenant's counter catches up if it had no work."""
        tenant = seq.tenant.name
        if self.waiting.fair is None:
            return
        active = self.waiting.tenants() | {s.tenant.name for s in self.running}
        if tenant not in active:
            self.fair.join(tenant, active)

    def check(self, seq: Sequence) -> None:
        """Raise ValueError if `add(seq)` would: `seq` is not new or can never run."""
        self._check_new(seq, len(seq))
        if seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"seq {seq.seq_id} must be new: no KV or blocks yet")

    def add_prefilled(
        self, seq: Sequence, block_ids: list[int], forks: Collection[Sequence] = ()
    ) -> bool:
        """Take a sequence whose K/V already sits in reserved `block_ids` for every token but
        its last, a token sampled elsewhere (the first output, or the next one of a request
        re-prefilled with the outputs it had streamed). Returns True if that token already
        ends it, in which case its blocks are released again (those its `forks`, further
        samples of its prompt, share stay theirs)."""
        self._check_new(seq, len(seq) - 1)
        self._check_forks(seq, forks)
        if seq.num_output_tokens < 1 or seq.num_computed_tokens != len(seq) - 1:
            raise ValueError(
                f"a prefilled seq has all its tokens but the newest computed and exactly one "
                f"output token beyond those it streamed before; seq {seq.seq_id} has "
                f"{seq.num_computed_tokens} of {len(seq)} tokens computed and "
                f"{seq.num_output_tokens} output tokens"
            )
        self.block_manager.attach(seq, block_ids)
        self._seqs[seq.seq_id] = seq
        self._register_forks(seq, forks)
        self._fork(seq)
        now = time.monotonic()
        seq.metrics.first_scheduled_time = seq.metrics.first_scheduled_time or now
        if self._on_token(seq, now):
            return True
        self._backlog(seq)
        self.waiting.push(seq)
        return False

    def _check_forks(self, parent: Sequence, forks: Collection[Sequence]) -> None:
        ids = {parent.seq_id}
        for child in forks:
            self.check(child)
            if child.seq_id in ids:
                raise ValueError(f"sequence id {child.seq_id!r} is given twice")
            if child.prompt_token_ids != parent.prompt_token_ids or child.num_output_tokens:
                raise ValueError(f"fork {child.seq_id} must be a fresh copy of the prompt")
            ids.add(child.seq_id)
        if forks and parent.num_computed_tokens > parent.num_prompt_tokens:
            raise ValueError("forks need a parent whose outputs are not computed yet")

    def _register_forks(self, parent: Sequence, forks: Collection[Sequence]) -> None:
        if not forks:
            return
        for child in forks:
            self._seqs[child.seq_id] = child
        self._forks[parent.seq_id] = list(forks)

    def _fork(self, parent: Sequence) -> None:
        """Start the samples waiting for `parent`, whose prompt K/V is computed: each shares
        the full blocks before the one holding the last prompt token and goes to the front
        of the waiting queue to compute the rest (at most a block) and sample."""
        forks = self._forks.pop(parent.seq_id, None)
        if not forks:
            return
        bs = self.block_manager.block_size
        shared = (parent.num_prompt_tokens - 1) // bs * bs
        for child in reversed(forks):
            self.block_manager.fork(parent, child, shared)
            child.num_computed_tokens = shared
            child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
            self.waiting.push_front(child)

    def _check_new(self, seq: Sequence, prompt_len: int) -> None:
        if seq.seq_id in self._seqs:
            raise ValueError(f"a sequence with id {seq.seq_id!r} is already scheduled")
        if seq.status != SequenceStatus.WAITING:
            raise ValueError(f"seq {seq.seq_id} is {seq.status.name}, not WAITING")
        if prompt_len >= self.max_seq_len:
            raise ValueError(
                f"seq {seq.seq_id} has {prompt_len} prompt tokens but prompt + output must stay "
                f"within {self.max_seq_len} ({self._length_limits}); shorten the prompt or "
                "raise the limit"
            )

    def abort(self, seq_id: int | str) -> Sequence:
        """Finish a sequence as cancelled and free its blocks (after its microbatch, if one
        is in flight)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"no unfinished sequence with id {seq_id!r}")
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif not self._drop_fork(seq):
            self.waiting.remove(seq)
        self._finish(seq, FinishReason.CANCELLED, time.monotonic())
        return seq

    def _drop_fork(self, seq: Sequence) -> bool:
        """Take `seq` out of the samples waiting for their parent; False if it is not one."""
        for forks in self._forks.values():
            if seq in forks:
                forks.remove(seq)
                return True
        return False

    # -- queries -----------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def get(self, seq_id: int | str) -> Sequence | None:
        return self._seqs.get(seq_id)

    # -- one step ----------------------------------------------------------------------------

    def schedule(self, max_seqs: int | None = None) -> SchedulerOutput:
        """The next microbatch of at most `max_seqs` sequences (default: no cap beyond
        `max_num_seqs`); may preempt running sequences and admit waiting ones."""
        out = SchedulerOutput()
        max_seqs = max_seqs or self.config.max_num_seqs
        budget = self.config.max_num_batched_tokens
        scheduled: set[int | str] = set()
        preempted = False
        now = time.monotonic()
        earlier_in_flight = bool(self._in_flight)  # microbatches submitted before this one
        out.scheduled_at, out.alone = now, not earlier_in_flight
        for seq in list(self.running):
            if budget == 0 or len(out) == max_seqs:
                break
            if seq.status != SequenceStatus.RUNNING or seq.seq_id in self._in_flight:
                continue
            room, evicted = self._make_room(seq, scheduled, earlier_in_flight)
            preempted |= evicted
            if not room:
                continue
            n = min(self._chunk(seq.num_uncomputed_tokens), budget)
            self._schedule(out, seq, n, scheduled, now)
            budget -= n
        if not preempted:
            self._admit(out, budget, max_seqs, scheduled, now)
        return out

    def _make_room(
        self, seq: Sequence, scheduled: set[int | str], earlier_in_flight: bool
    ) -> tuple[bool, bool]:
        """Ensure `seq`'s table covers its tokens, preempting the newest running sequences.
        Returns (seq can run now, something was preempted)."""
        evicted = False
        while not self.block_manager.can_append(seq):
            victim = self._newest_preemptible(scheduled)
            if victim is None or (victim is seq and earlier_in_flight):
                return False, evicted  # wait: in-flight sequences will land or grow first
            self._preempt(victim)
            evicted = True
            if victim is seq:
                return False, evicted
        self.block_manager.append_slot(seq)
        return True, evicted

    def _newest_preemptible(self, scheduled: set[int | str]) -> Sequence | None:
        """The newest running sequence not in this or an earlier microbatch (priority
        policy: the newest of the lowest priority; among tenants of the lowest tenant
        priority, of the most served)."""
        candidates = [
            s for s in self.running if s.seq_id not in self._in_flight and s.seq_id not in scheduled
        ]
        if not candidates:
            return None
        if self.config.scheduling_policy == "priority":
            level, counter = self.waiting.level, self.fair.counter
            worst = max(level(s) for s in candidates)
            candidates = [s for s in candidates if level(s) == worst]
            most = max(counter(s.tenant.name) for s in candidates)
            candidates = [s for s in candidates if counter(s.tenant.name) == most]
            lowest = max(s.priority for s in candidates)
            candidates = [s for s in candidates if s.priority == lowest]
        return candidates[-1]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(seq)

    def _admit(
        self,
        out: SchedulerOutput,
        budget: int,
        max_seqs: int,
        scheduled: set[int | str],
        now: float,
    ) -> None:
        bm, slo = self.block_manager, self.slo
        skip: set[int | str] = set()  # waiting sequences that cannot start this step
        num_long = sum(1 for s in self.running if self._in_long_prefill(s))
        while (
            self.waiting
            and budget > 0
            and len(out) < max_seqs
            and len(self.running) < self.config.max_num_seqs
        ):
            if slo is None:
                seq = self.waiting.first(skip)
            else:
                backlog = slo.backlog(self.running)

                def lead(seq: Sequence, ahead: int, backlog: int = backlog) -> float:
                    return slo.lead_s(seq, backlog + ahead)

                seq = self.waiting.peek(now, lead, self.config.late_yield_s, skip)
                if seq is not None and not slo.allows(seq, self.running, now, backlog):
                    return
            if seq is None:
                return
            fresh = not seq.block_table and seq.num_computed_tokens == 0
            if fresh and bm.waits_for(seq):
                skip.add(seq.seq_id)  # its prefix is being computed: next step it is cached
                continue
            left = seq.num_uncomputed_tokens - (bm.num_cached_tokens(seq) if fresh else 0)
            long = self._is_long(left)
            if long and num_long >= self.config.max_long_partial_prefills:
                skip.add(seq.seq_id)  # keeps its place; shorter prompts go beside the long
                continue
            n = self._chunk(left)
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    return
                n = budget
            if seq.block_table:  # arrived prefilled
                if not bm.can_append(seq):
                    return
                bm.append_slot(seq)
            else:
                reserve = self._watermark_blocks if self.running else 0
                if bm.num_blocks_to_allocate(seq) + reserve > bm.num_free_blocks:
                    return
                bm.allocate(seq)  # its cached prefix, if any, counts as computed
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._schedule(out, seq, n, scheduled, now)
            budget -= n
            num_long += long

    def _in_long_prefill(self, seq: Sequence) -> bool:
        """Whether running `seq` is a prompt still being computed over several steps (long,
        or cut by the budget); its last chunk counts, so the next long prompt starts once
        this one has its first token."""
        return self._long_threshold > 0 and seq.num_uncomputed_tokens > 1

    def _is_long(self, num_tokens: int) -> bool:
        """Whether a prompt with `num_tokens` left to compute is long."""
        return 0 < self._long_threshold < num_tokens

    def _chunk(self, num_tokens: int) -> int:
        """What a step computes of `num_tokens` left (the budget aside)."""
        return self._long_threshold if self._is_long(num_tokens) else num_tokens

    def _schedule(
        self, out: SchedulerOutput, seq: Sequence, n: int, scheduled: set[int | str], now: float
    ) -> None:
        out.add(seq, n)
        self.block_manager.cache_computed(seq, seq.num_computed_tokens + n)
        scheduled.add(seq.seq_id)
        self._in_flight.add(seq.seq_id)
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = now

    def update(self, out: SchedulerOutput, token_ids: Iterable[int | None]) -> list[Sequence]:
        """Apply a finished microbatch: advance computed counts, append sampled tokens, check
        stop conditions. Returns the sequences that got a token (finished ones included)."""
        now = time.monotonic()
        if out.alone:
            self.step_times.record(out, now - out.scheduled_at)
        changed: list[Sequence] = []
        finished = False
        for seq, n, token in zip(out.seqs, out.num_new_tokens, token_ids, strict=True):
            if self._land(seq):
                continue
            sampled = token is not None
            self.fair.charge(seq.tenant, n - sampled, int(sampled))
            seq.num_computed_tokens += n
            self.block_manager.cache_computed(seq)
            if self._forks and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self._fork(seq)
            if token is None:
                continue
            seq.append_token(token)
            changed.append(seq)
            if self._on_token(seq, now):
                finished = True
        if finished:
            self.running = [s for s in self.running if not s.is_finished]
        return changed

    def _land(self, seq: Sequence) -> bool:
        """`seq`'s microbatch is back; True (and its blocks freed) if it was aborted meanwhile."""
        self._in_flight.discard(seq.seq_id)
        if not seq.is_finished:
            return False
        if seq.block_table:
            self.block_manager.free(seq)
        return True

    def fail(self, out: SchedulerOutput) -> list[Sequence]:
        """The microbatch `out` could not run: end its sequences with an error."""
        now = time.monotonic()
        failed = []
        self.block_manager.reset_prefix_cache()  # blocks named for this step hold no K/V
        for seq in out.seqs:
            if self._land(seq):
                continue
            self._finish(seq, FinishReason.ERROR, now)
            failed.append(seq)
        self.running = [s for s in self.running if not s.is_finished]
        return failed

    # -- finishing ---------------------------------------------------------------------------

    def _on_token(self, seq: Sequence, now: float) -> bool:
        """Record the token just appended to `seq`; finish `seq` if it ends here."""
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        seq.metrics.last_token_time = now
        token = seq.last_token_id
        reason = self._finish_reason(seq, token)
        if reason is None:
            return False
        self._finish(seq, reason, now)
        return True

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        return finish_reason(seq, token, self.eos_token_ids, self.max_seq_len)

    def _finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = now
        if seq.block_table and seq.seq_id not in self._in_flight:
            self.block_manager.free(seq)
        del self._seqs[seq.seq_id]
        for child in self._forks.pop(seq.seq_id, ()):  # ended before its prompt was computed
            self._finish(child, reason, now)

