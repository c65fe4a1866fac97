"""The disaggregated cluster: arrivals feed a batcher (the real BucketManager, or the FCFS
baseline's), idle prefill workers pull its batches for the decode worker the P/D scheduler
picks, whose blocks are reserved before prefill starts; K/V lands and joins continuous
batching on the real Scheduler. The batcher's and the P/D scheduler's cost is measured
around each of their calls twice: wall clock (`*_s`) and this thread's CPU time
(`*_cpu_s`, which a busy shared machine does not inflate).

With `remote_prefill` other than `always`, the service's own `PDScheduler.route` sends each
request of a batch to a prefill worker or lets its decode worker prefill it within its
steps (`never`: always the latter), priced from the cost model as the service prices them
from its workers' measurements (`PathCosts`). `layerwise` ships each layer's K/V as soon as
it is computed instead of after the prefill.

With `prefix_caching` every worker's pool caches what it computed (the real BlockManager):
a prefill computes only the prompt tokens its worker's cache lacks, and a transfer ships
only the blocks the decode worker lacks. Requests are queued with their blocks' hashes and
the cached length the P/D scheduler's index expects; with `cache_aware` the scheduler also
places each batch by cache (`PDScheduler.place_decode`, `prefer_cached`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Protocol

from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.decode_worker import EOS, TOKEN, DecodeWorker
from benchmarks.simulator.event_loop import EventLoop
from benchmarks.simulator.metrics import RequestRecord, RunResult
from benchmarks.simulator.prefill_worker import PrefillWorker
from benchmarks.simulator.workload import SimRequest, prompt_tokens
from bucketserve.bucket_manager import BucketRequest, PrefillBatch
from bucketserve.controller.pd_scheduler import PREFILL_PATHS, PathCosts, PDScheduler
from bucketserve.kv_transfer.lease import Lease
from bucketserve.runtime.core.block_hash import block_hashes
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.scheduler import SchedulerConfig
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.utils.checks import check_choice, check_int

PAD_MODES = ("shape", "longest", "none")


def _stamp() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


class Batcher(Protocol):
    def __len__(self) -> int: ...
    def add(self, request: BucketRequest) -> None: ...
    def next_batch(self, free_blocks: int, block_size: int, now: float) -> PrefillBatch | None: ...
    def requeue(self, batch: PrefillBatch) -> None: ...


class Simulator:
    """`pad`: a prefill batch runs padded to its shape bucket, to its longest prompt, or
    varlen. `commits_output`: decode room counts prompt + max_tokens per live sequence.
    `prefix_caching`, `cache_aware`: the module's. `max_batches_per_prefill`: batches a
    prefill worker takes at once, the later ones queued at it (the service's default is 2;
    1 takes a batch only when the worker is free)."""

    def __init__(
        self,
        name: str,
        cluster: ClusterConfig,
        batcher: Batcher,
        pad: str,
        commits_output: bool,
        tenant: str = "default",
        prefix_caching: bool = False,
        cache_aware: bool = False,
        max_batches_per_prefill: int = 1,
        remote_prefill: str = "always",
        layerwise: bool = False,
    ) -> None:
        check_choice("pad", pad, PAD_MODES)
        check_choice("remote_prefill", remote_prefill, PREFILL_PATHS)
        self.remote_prefill = remote_prefill
        self.layerwise = layerwise
        check_int("max_batches_per_prefill", max_batches_per_prefill, 1)
        if cache_aware and not prefix_caching:
            raise ValueError("cache-aware placement needs prefix caching in the workers")
        self.name = name
        self.cluster = cluster
        self.batcher = batcher
        self.pad = pad
        self.tenant = tenant
        self.prefix_caching = prefix_caching
        self.loop = EventLoop()
        self.cost = cluster.cost_model()
        blocks = cluster.num_kv_blocks()
        self.max_commit = int(0.9 * blocks)
        config = SchedulerConfig(
            max_num_seqs=cluster.max_num_seqs,
            max_num_batched_tokens=max(2048, cluster.model_spec.max_len),
        )
        self.decode = [
            DecodeWorker(
                i,
                self.loop,
                self.cost,
                blocks,
                cluster.block_size,
                config,
                commits_output,
                self._finished,
                prefix_caching,
            )
            for i in range(cluster.num_decode)
        ]
        link = cluster.link_spec
        pool = blocks if prefix_caching else None
        self.prefill = [
            PrefillWorker(i, self.loop, self.cost, link, pool, cluster.block_size, layerwise)
            for i in range(cluster.num_prefill)
        ]
        self._token_s = self._prefill_token_s()
        self.max_batches_per_prefill = max_batches_per_prefill
        # a free prefill slot per entry, taken from the end
        self._idle = list(reversed(self.prefill)) * max_batches_per_prefill
        # the service's own
        self.pd = PDScheduler(cluster.num_decode, cluster.block_size, cache_aware=cache_aware)
        for worker in self.decode:
            worker.on_room_change = self._room_changed
            worker.on_first_token = self._first_token
            self._room_changed(worker)
        self._step_tokens = config.max_num_batched_tokens
        self.records: dict[int, RequestRecord] = {}
        self._requests: dict[int, SimRequest] = {}
        self._tokens: dict[int, list[int]] = {}  # with prefix caching, until it finishes
        self._params: dict[int, SamplingParams] = {}
        self.cpu = dict.fromkeys(
            ("bucket_manager_s", "pd_scheduler_s", "bucket_manager_cpu_s", "pd_scheduler_cpu_s"),
            0.0,
        )
        self.counts = {"batches": 0, "batched_requests": 0, "real_tokens": 0, "padded_tokens": 0}
        self.counts["graph_misses"] = 0
        self.counts["max_buckets"] = 1
        self.counts["failed_reservations"] = 0
        self.counts["max_queued"] = 0
        self.counts["cached_tokens"] = 0  # prompt tokens a prefill found cached
        self.counts["unshipped_tokens"] = 0  # prompt tokens a decode worker held already
        self.counts["local_prefills"] = 0  # requests their decode worker prefilled
        self.counts["held_for_prefill"] = 0  # batches held back for a prefill slot

    # -- driving -----------------------------------------------------------------------------

    def run(self, requests: Iterable[SimRequest], until: float = math.inf) -> RunResult:
        for request in requests:
            self._check(request)
            self.loop.at(request.arrival, self._arrive, request)
        self.loop.run(until)
        return RunResult(
            self.name,
            list(self.records.values()),
            self.cluster.num_workers,
            sum(w.busy_s for w in self.prefill) + sum(w.busy_s for w in self.decode),
            self.loop.now,
            self._stats(),
        )

    def _check(self, request: SimRequest) -> None:
        blocks = -(-(request.prompt_len + request.max_tokens) // self.cluster.block_size)
        if blocks > self.max_commit:
            raise ValueError(
                f"request {request.request_id} needs {blocks} KV blocks but a decode worker "
                f"can promise at most {self.max_commit}; lower max_tokens or the prompt length"
            )
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id} appears twice in the workload")
        self._requests[request.request_id] = request

    def _arrive(self, request: SimRequest) -> None:
        self.records[request.request_id] = RequestRecord(
            request.prompt_len, request.output_len, request.arrival
        )
        start = _stamp()
        hashes, cached = self._expected_prefix(request)
        item = BucketRequest(
            request.request_id,
            request.prompt_len,
            request.max_tokens,
            tenant=self.tenant,
            arrival_time=request.arrival,
            cached_len=cached,
            block_hashes=hashes,
        )
        estimated = _stamp()
        self.batcher.add(item)
        self._charge("pd_scheduler", start, estimated)
        self._charge("bucket_manager", estimated, _stamp())
        self._dispatch()

    def _expected_prefix(self, request: SimRequest) -> tuple[tuple[int, ...], int]:
        """The prompt's block hashes and the prefix a prefill worker is expected to hold,
        as the service's Dispatcher queues them (none without prefix caching)."""
        if not self.prefix_caching:
            return (), 0
        tokens = self._tokens[request.request_id] = prompt_tokens(request)
        hashes = tuple(block_hashes(tokens, self.cluster.block_size))
        return hashes, self.pd.expected_cached(self.pd.prefill_cache, hashes, len(tokens))

    def _dispatch(self) -> None:
        held: list[PrefillBatch] = []  # cheaper remote, waiting for a prefill slot
        try:
            self._dispatch_remote_or_local(held)
        finally:
            for batch in held:
                self.batcher.requeue(batch)

    def _dispatch_remote_or_local(self, held: list[PrefillBatch]) -> None:
        while len(self.batcher) and (self._idle or self.remote_prefill != "always"):
            start = _stamp()
            worker = self.pick_decode()
            picked = _stamp()
            batch = self.batcher.next_batch(
                max(0, worker.room), self.cluster.block_size, self.loop.now
            )
            batched = _stamp()
            self._charge("pd_scheduler", start, picked)
            self._charge("bucket_manager", picked, batched)
            self._track_buckets()
            if batch is None:
                return
            if self.remote_prefill != "always":
                start = _stamp()
                local, batch = self.pd.route(batch, self._costs(worker), self.remote_prefill)
                self._charge("pd_scheduler", start, _stamp())
                if local is not None:
                    self._prefill_locally(worker, local)
                if batch is None:
                    continue
                if not self._idle:
                    held.append(batch)
                    self.counts["held_for_prefill"] += 1
                    continue
            worker, prefill = self._place(batch, worker)
            # as the service's Handoff: requests that end at their first token reserve nothing
            going = [i for i, r in enumerate(batch.requests) if not self.pd.ends_at_prefill(r)]
            lease = self._reserve(worker, batch, going) if going else None
            reserved = _stamp()
            self._charge("pd_scheduler", batched, reserved)
            if going and lease is None:  # the batcher's designed path for a failed reservation
                self.batcher.requeue(batch)
                self._charge("bucket_manager", reserved, _stamp())
                self.counts["failed_reservations"] += 1
                return
            start = _stamp()
            self.pd.dispatched(batch, worker.index, self._idle[prefill].index)
            self._charge("pd_scheduler", start, _stamp())
            self._launch(self._idle.pop(prefill), batch, worker, going, lease and lease.lease_id)

    def _prefill_token_s(self) -> float:
        """A prompt token's seconds on a prefill worker, as the service measures it: a
        2,048-token batch's time over its tokens."""
        tokens = min(2048, self.cluster.model_spec.max_len)
        return self.cost.time(self.cost.prefill_work([tokens])) / tokens

    def _costs(self, decode: DecodeWorker) -> PathCosts:
        """What each path costs the next batch on `decode` now (the service's `PathCosts`,
        from the cost model where the service has its workers' measurements)."""
        running = decode.scheduler.running
        context = sum(s.num_computed_tokens for s in running)
        step = self.cost.time(self.cost.decode_work(len(running), context)) if running else 0.0
        # what a prompt token adds to one of its steps, as the engine's StepTimes measures it
        chunk = self._step_tokens
        rows = [s.num_computed_tokens for s in running]
        mixed = self.cost.time(self.cost.work([chunk] + [1] * len(rows), [0, *rows]))
        marginal = (mixed - step) / chunk
        per_token = self.cost.transfer_time(1000, self.cluster.link_spec) / 1000
        queued = sum(self.pd.prefill_queued.values()) * self.cluster.block_size
        return PathCosts(
            prefill_token_s=self._token_s,
            prefill_backlog_tokens=queued / len(self.prefill),
            prefill_open=bool(self._idle),
            transfer_token_s=per_token,
            layerwise=self.layerwise,
            num_layers=self.cluster.model_spec.num_layers,
            decode_token_s=marginal,
            decode_step_s=step,
            decode_backlog_tokens=decode.prompt_tokens_to_come,
            decode_running=len(running),
            step_tokens=self._step_tokens,
        )

    def _prefill_locally(self, decode: DecodeWorker, batch: PrefillBatch) -> None:
        """The batch's requests join `decode`'s engine unprefilled, as in the colocated
        shape; their first tokens come from its steps."""
        self.pd.dispatched(batch, decode.index)
        now = self.loop.now
        for item, commit in zip(batch.requests, batch.kv_blocks_per_request, strict=True):
            request = self._requests[item.request_id]
            self.records[request.request_id].prefill_start = now
            seq = Sequence(
                list(self._tokens.get(request.request_id, [TOKEN] * request.prompt_len)),
                self._sampling(request.max_tokens),
                seq_id=request.request_id,
                arrival_time=request.arrival,
            )
            self.counts["local_prefills"] += 1
            decode.add_prompt(seq, request.output_len, commit)

    def _first_token(self, seq: Sequence) -> None:
        record = self.records[seq.seq_id]
        record.first_token = record.decode_start = self.loop.now

    def pick_decode(self) -> DecodeWorker:
        """The decode worker the next batch reserves on: the service's PDScheduler's choice."""
        return self.decode[self.pd.pick_decode()]

    def _place(self, batch: PrefillBatch, decode: DecodeWorker) -> tuple[DecodeWorker, int]:
        """The decode worker and the prefill slot (its position in `_idle`) that take
        `batch`: `decode` and the last slot of a least busy prefill worker, unless the P/D
        scheduler places by cache."""
        idle = self._idle
        last = len(idle) - 1
        if self.max_batches_per_prefill > 1:
            fewest = min(w.assigned for w in idle)
            last = max(i for i, w in enumerate(idle) if w.assigned == fewest)
        pd = self.pd
        if not pd.cache_aware:
            return decode, last
        controller = getattr(self.batcher, "controller", None)
        room = controller.room_for(batch.kv_blocks) if controller else batch.kv_blocks
        decode = self.decode[pd.place_decode(batch, room)]
        held = pd.holders(pd.prefill_cache, batch)
        need = sum(pd.blocks(r.prompt_len) for r in batch.requests)
        queued = pd.prefill_queued
        loads = {w.index: queued.get(w.index, 0) for w in idle if w.index in held}
        loads = {w: load for w, load in loads.items() if self.prefill[w].free_blocks >= need}
        default = idle[last]
        loads[default.index] = queued.get(default.index, 0)
        chosen = pd.prefer_cached(pd.prefill_cache, batch, default.index, loads)
        if chosen == default.index:
            return decode, last
        return decode, next(i for i, w in enumerate(idle) if w.index == chosen)

    def _room_changed(self, worker: DecodeWorker) -> None:
        self.pd.update(worker.index, worker.room, worker.load)

    def _reserve(self, worker: DecodeWorker, batch: PrefillBatch, going: list[int]) -> Lease | None:
        """Hold the blocks of the batch's requests at positions `going` on `worker` under one
        lease (kv_transfer's LeaseTable); None when they are not free (prompt-only
        accounting leaves out the first token)."""
        lens = [batch.requests[i].prompt_len for i in going]
        if not worker.can_reserve(lens):
            return None
        ids = [batch.requests[i].request_id for i in going]
        commits = [batch.kv_blocks_per_request[i] for i in going]
        prompts = [self._tokens[i] for i in ids] if self.prefix_caching else None
        return worker.reserve(ids, lens, commits, prompts)

    def _charge(self, part: str, start: tuple[float, float], end: tuple[float, float]) -> None:
        self.cpu[f"{part}_s"] += end[0] - start[0]
        self.cpu[f"{part}_cpu_s"] += end[1] - start[1]

    def _track_buckets(self) -> None:
        self.counts["max_queued"] = max(self.counts["max_queued"], len(self.batcher))
        buckets = getattr(self.batcher, "buckets", None)  # the BucketManager's request buckets
        if buckets is not None:
            self.counts["max_buckets"] = max(self.counts["max_buckets"], len(buckets.buckets))

    def _launch(
        self,
        prefill: PrefillWorker,
        batch: PrefillBatch,
        decode: DecodeWorker,
        going: list[int],
        lease_id: str | None,
    ) -> None:
        prompts = [r.prompt_len for r in batch.requests]
        tokens = [self._tokens.get(r.request_id, ()) for r in batch.requests]
        cached = prefill.lookup(tokens) if self.prefix_caching else [0] * len(prompts)
        lens = [n - c for n, c in zip(prompts, cached, strict=True)]  # tokens computed
        pad_to = self._pad_to(batch, lens, cached)
        now = self.loop.now
        for request in batch.requests:
            self.records[request.request_id].prefill_start = now
        c = self.counts
        c["batches"] += 1
        c["batched_requests"] += len(lens)
        c["real_tokens"] += sum(lens)
        c["cached_tokens"] += sum(cached)
        c["padded_tokens"] += pad_to[0] * pad_to[1] if pad_to else sum(lens)
        c["graph_misses"] += batch.graph_miss or (self.pad == "shape" and pad_to is None)
        held = decode.cached_blocks.get(lease_id, [0] * len(going)) if lease_id else []
        unshipped = sum(held) * self.cluster.block_size
        c["unshipped_tokens"] += unshipped
        blocks = sum(self.pd.blocks(n) for n in prompts)
        computed = sum(self.pd.blocks(n) for n in lens)
        prefill.assigned += 1
        prefill.pending_blocks += blocks
        self.pd.prefill_sent(prefill.index, computed)
        prefill.submit(
            lens,
            pad_to,
            lambda: self._free(prefill, blocks, computed),
            lambda: self._prefilled(batch),
            lambda: self._landed(batch, going, decode, lease_id),
            shipped=sum(prompts[i] for i in going) - unshipped,
            context_lens=cached,
        )

    def _pad_to(
        self, batch: PrefillBatch, lens: list[int], cached: list[int]
    ) -> tuple[int, ...] | None:
        """The padded (rows, query, context tokens) a batch runs at, computing `lens` tokens
        over `cached` ones; None: varlen. A shape bucket sized for a longer cached prefix
        than the worker had does not hold the query: the batch runs unpadded (a miss)."""
        if self.pad == "none":
            return None
        if self.pad == "longest":
            return (len(lens), max(lens), max(cached))
        rows, query, ctx = batch.shape
        if rows < len(lens) or query < max(lens):
            return None
        shapes = getattr(self.batcher, "shapes", None)
        return (rows, query, ctx * shapes.config.block_size if shapes else 0)

    def _free(self, prefill: PrefillWorker, blocks: int, computed: int) -> None:
        prefill.assigned -= 1
        prefill.pending_blocks -= blocks
        self.pd.prefill_done(prefill.index, computed)
        self._idle.append(prefill)
        self._dispatch()

    def _prefilled(self, batch: PrefillBatch) -> None:
        for request in batch.requests:
            self.records[request.request_id].first_token = self.loop.now
            if self.pd.ends_at_prefill(request):
                self._finish(request.request_id, 1, 0)

    def _landed(
        self, batch: PrefillBatch, going: list[int], decode: DecodeWorker, lease_id: str
    ) -> None:
        blocks = decode.land(lease_id)
        items = [batch.requests[i] for i in going]
        commits = [batch.kv_blocks_per_request[i] for i in going]
        for item, block_ids, commit in zip(items, blocks, commits, strict=True):
            request = self._requests[item.request_id]
            self.records[request.request_id].decode_start = self.loop.now
            seq = Sequence(
                list(self._tokens.get(request.request_id, [TOKEN] * request.prompt_len)),
                self._sampling(request.max_tokens),
                seq_id=request.request_id,
                arrival_time=request.arrival,
            )
            seq.num_computed_tokens = request.prompt_len
            seq.append_token(EOS if request.output_len <= 1 else TOKEN)
            decode.admit(seq, block_ids, request.output_len, commit)

    def _sampling(self, max_tokens: int) -> SamplingParams:
        if max_tokens not in self._params:
            self._params[max_tokens] = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        return self._params[max_tokens]

    def _finished(self, seq: Sequence, output_tokens: int, preemptions: int) -> None:
        self._finish(seq.seq_id, output_tokens, preemptions)

    def _finish(self, request_id: int, output_tokens: int, preemptions: int) -> None:
        record = self.records[request_id]
        if record.finish is not None:
            raise RuntimeError(f"request {request_id} finished twice")
        self._tokens.pop(request_id, None)
        record.finish = self.loop.now
        record.preemptions = preemptions
        if output_tokens != record.output_len:
            raise RuntimeError(
                f"request {request_id} produced {output_tokens} tokens, "
                f"expected {record.output_len}"
            )
        if len(self.batcher):
            self._dispatch()

    def _stats(self) -> dict:
        c = self.counts
        return {
            **self.cpu,
            **c,
            "mean_batch_size": c["batched_requests"] / max(1, c["batches"]),
            "prefill_padding": 1 - c["real_tokens"] / max(1, c["padded_tokens"]),
            "preemptions": sum(w.scheduler.num_preemptions for w in self.decode),
            "stall_recoveries": sum(w.recoveries for w in self.decode),
            "leases_closed": sum(w.leases.counts.closed for w in self.decode),
            "decode_steps": sum(w.steps for w in self.decode),
            "decode_bubble_fraction": _mean(w.stages.bubble_fraction for w in self.decode),
            "prefill_bubble_fraction": _mean(w.stages.bubble_fraction for w in self.prefill),
            "events": self.loop.events_run,
            "bucket_splits": getattr(getattr(self.batcher, "buckets", None), "splits", 0),
            "bucket_merges": getattr(getattr(self.batcher, "buckets", None), "merges", 0),
        }


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
