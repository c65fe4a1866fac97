"""Dispatch, both deployment topologies: queued requests -> PDScheduler choices -> batches on their
way to a decode worker, through a Handoff (disaggregated) or straight into its engine
(colocated).

The Dispatcher owns the queue side of a request's life (the BucketManager, the PDScheduler,
queuing, putting a batch back, the phase a request is in on its way). Each batch it sends
is a `Flight`: the outcomes of its way, in order, which the Controller applies to the
request table, the output streams and its fault policy (`outcomes.py`), as the Handoff
returns its own outcomes to the Dispatcher.

With prefix caching on, a request is queued with its blocks' hashes and the prefix the best
worker is expected to hold as its cached length, and each batch goes where its prompts'
blocks were sent before (the PDScheduler's cache-aware placement).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Hashable, Iterator

from bucketserve.bucket_manager.bucket_manager import BucketManager
from bucketserve.bucket_manager.config import TenantConfig
from bucketserve.bucket_manager.prefill_batch import PrefillBatch
from bucketserve.bucket_manager.prefill_cost import ForecastBias, PrefillCost, some_worker_absorbs
from bucketserve.bucket_manager.request import BucketRequest
from bucketserve.controller.config import ControllerConfig
from bucketserve.controller.handoff import Admitted, Handoff
from bucketserve.controller.outcomes import (
    AbortOnWorker,
    Deliver,
    FailRequest,
    Flight,
    Outcome,
    Requeue,
)
from bucketserve.controller.pd_scheduler import PathCosts, PDScheduler, subset
from bucketserve.controller.prefix_index import PrefixIndex
from bucketserve.controller.request_state import RequestState
from bucketserve.controller.service_limits import ServiceLimits
from bucketserve.controller.service_monitor import ServiceMonitor
from bucketserve.controller.worker_handle import Failure, WorkerHandle
from bucketserve.controller.worker_pool import WorkerPool
from bucketserve.kv_transfer.transport import LAYERWISE
from bucketserve.messages import PrefillResult, WorkerRequest
from bucketserve.runtime.core.block_hash import block_hashes
from bucketserve.utils.moving_average import moving_average


class Dispatcher:
    """Forms batches while a prefill worker has a free slot (colocated: none is needed) and
    a decode worker has room; the PDScheduler makes each choice. `dispatch()` returns the
    flights of the batches it formed; `woken()` waits until room, slots or queued requests
    may have changed."""

    def __init__(
        self,
        config: ControllerConfig,
        limits: ServiceLimits,
        pool: WorkerPool,
        monitor: ServiceMonitor,
    ) -> None:
        self.config = config
        self.limits = limits
        self.pool = pool
        self.monitor = monitor
        self.buckets: BucketManager[RequestState] = BucketManager(limits.buckets)
        caching = config.runner.enable_prefix_caching
        self.pd = PDScheduler(config.decode.num_workers, limits.block_size, cache_aware=caching)
        self._epochs: dict[str, int] = {}  # each worker's life its index entries are from
        self.handoff_s: float | None = None  # a handoff's calls beyond its compute and KV
        self.ttft_bias = ForecastBias()
        self._wake = asyncio.Event()

    # -- the queue ---------------------------------------------------------------------------

    def queue(
        self, state: RequestState, request: BucketRequest[RequestState] | None = None
    ) -> None:
        """Queue `state` for a prefill of everything it has so far (`request`: its
        `bucket_request`, when the caller has it already)."""
        state.phase, state.decode_worker = "queued", None
        self.buckets.add(request or self.bucket_request(state))
        self.wake()

    def bucket_request(self, state: RequestState) -> BucketRequest[RequestState]:
        """`state` as the bucket manager queues it: its tokens so far as the prompt, the
        prefix the best worker holds of them as cached."""
        left = state.request.sampling_params.max_tokens - len(state.output_token_ids)
        hint = self.limits.max_tokens_hint(left, state.num_tokens)
        if state.n > 1:  # per sample: n samples' growth must fit the pool together
            hint = max(1, hint // state.n)
        request = state.bucket_request(hint)
        if self.pd.cache_aware:
            request = self._with_prefix(request, state)
        return request

    def forecast_ttft(self, request: BucketRequest) -> float | None:
        """The seconds until `request`'s first token if queued now, priced by the workers'
        measured prompt costs (`PrefillCost`): the prompt tokens the bucket manager serves
        before it (`BucketManager.tokens_ahead`: its tenant's priority and fair share),
        those already sent to workers, and its own. None until the workers measured.
        `ttft_bias` corrects them by how far such forecasts fell short of first tokens."""
        c = self.config
        workers = [
            h for h in self.pool.role("decode" if c.colocated else "prefill", alive=True)
            if h.stats is not None and h.stats.prefill_token_s is not None
        ]  # fmt: skip
        if not workers:
            return None
        token_s = sum(h.stats.prefill_token_s for h in workers) / len(workers)
        if c.colocated:
            steps = [h.stats.decode_step_s for h in workers if h.stats.decode_step_s is not None]
            cost = PrefillCost(
                token_s, sum(steps) / len(steps) if steps else 0.0,
                c.decode.max_num_batched_tokens, len(workers),
            )  # fmt: skip
            sent = sum(h.stats.prompt_tokens_to_come for h in workers)
        else:
            cost = PrefillCost(token_s, workers=len(workers))
            sent = sum(self.pd.prefill_queued.values()) * self.limits.block_size
        own = request.effective_len
        ahead = self.buckets.tokens_ahead(request.tenant, own) + sent
        return cost.seconds(ahead + own)

    def tpot_room(self, request: BucketRequest) -> bool:
        """Whether some decode worker's running requests can absorb, within their TPOT
        targets, every prompt token it will compute before `request`'s first token
        (`some_worker_absorbs`, from each worker's last report). The engine holds a prompt
        back for its running requests' TPOT on the same terms, so one admitted past this
        would wait there and miss its TTFT."""
        own = request.effective_len
        workers = [
            None if s is None else (s.prompt_tokens_to_come, s.prefill_token_s, s.tpot_slack_s)
            for s in (h.stats for h in self.pool.role("decode", alive=True))
        ]
        return some_worker_absorbs(own, self.buckets.tokens_ahead(request.tenant, own), workers)

    def first_token(self, state: RequestState) -> None:
        """`state`'s first token came: how it compares with its forecast corrects the next."""
        if state.forecast_ttft_s is not None and state.requeues == 0:
            actual = state.first_token_at - state.request.arrival_time
            self.ttft_bias.observe(state.forecast_ttft_s, actual)

    def _with_prefix(
        self, request: BucketRequest[RequestState], state: RequestState
    ) -> BucketRequest[RequestState]:
        """`request` with its blocks' hashes, and the prefix the worker that would compute it
        best holds as its cached length (none for prompt logprobs: every position computes)."""
        tokens = [*state.request.prompt_token_ids, *state.output_token_ids]
        root = self._tenant(state).tag(state.request.cache_salt).cache_root
        hashes = tuple(block_hashes(tokens, self.limits.block_size, root=root))
        index, cached = self._compute_cache(), 0
        if index is not None and state.request.sampling_params.prompt_logprobs is None:
            cached = self.pd.expected_cached(index, hashes, request.prompt_len)
        return dataclasses.replace(request, cached_len=cached, block_hashes=hashes)

    def _compute_cache(self) -> PrefixIndex | None:
        """The index of the workers that compute prompts, when their caches skip tokens: the
        decode workers' (colocated), the prefill workers' once each reports lookups. Workers
        that died since they were last seen hold nothing in it."""
        if self.config.colocated:
            decodes = self.pool.role("decode")
            self._forget_past_lives(decodes, self.pd.decode_cache, lambda i, h: i)
            return self.pd.decode_cache
        prefills = self.pool.role("prefill", alive=True)
        self._forget_past_lives(prefills, self.pd.prefill_cache, lambda i, h: h.name)
        if prefills and all(getattr(h.stats, "prefix_cache_queries", 0) for h in prefills):
            return self.pd.prefill_cache
        return None

    def reset_prefix_cache(self) -> None:
        """The workers' prefix caches were reset: nothing is believed cached anywhere."""
        self.pd.reset_prefix_cache()

    def put_back(self, batch: PrefillBatch[RequestState], count: bool) -> list[Outcome]:
        """A batch that never reached prefill goes back where its requests were; those that
        have failed too often (`count`: this was a failed try) end instead."""
        keep, ended = [], []
        for i, request in enumerate(batch.requests):
            state = request.item
            if state.done:
                continue
            if count:
                state.requeues += 1
                if state.requeues > self.config.max_requeues:
                    ended.append(FailRequest(state, "its prefill failed too often"))
                    continue
            state.phase, state.decode_worker = "queued", None
            keep.append(i)
        if keep:
            self.buckets.requeue(subset(batch, keep))
        self.wake()
        return ended

    # -- the loop ----------------------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    async def woken(self) -> None:
        await self._wake.wait()
        self._wake.clear()

    def dispatch(self) -> list[Flight]:
        """Form every batch the workers have room and slots for now; their flights, each
        booked on its workers already."""
        if self.config.colocated:
            return self._dispatch_colocated()
        return self._dispatch_disaggregated()

    def _dispatch_disaggregated(self) -> list[Flight]:
        """Each batch's requests go to a prefill worker and hand their KV over, or straight
        to their decode worker's engine, as `controller.remote_prefill` and each path's cost
        say (`PDScheduler.route`); those cheaper remote while no prefill worker has a slot
        wait in the bucket manager for the next."""
        held: list[PrefillBatch[RequestState]] = []
        try:
            return self._dispatch_remote_or_local(held)
        finally:
            for batch in held:
                self.buckets.requeue(batch)

    def _dispatch_remote_or_local(self, held: list[PrefillBatch[RequestState]]) -> list[Flight]:
        pd, flights, mode = self.pd, [], self.config.remote_prefill
        limit = self.config.prefill.max_batches
        while len(self.buckets):
            prefills = self.pool.role("prefill", alive=True)
            skips_cached = self._compute_cache() is not None  # the prefill workers' caches
            free = [h.free_blocks for h in prefills]
            inflight = [h.inflight for h in prefills]
            p = pd.pick_prefill(free, inflight, limit)
            decode = self.pick_decode()
            if decode is None or (p is None and mode == "always"):
                break
            batch = self._next_batch(decode)
            if batch is None:
                break
            decode = self._place_decode(batch, decode)
            local, batch = pd.route(batch, self._path_costs(decode, prefills, p), mode)
            if local is not None:
                flights.append(self._prefill_locally(decode, local))
            if batch is None:
                continue
            if p is None:
                held.append(batch)
                continue
            if skips_cached:
                names = [h.name for h in prefills]
                p = pd.place_prefill(batch, names, free, inflight, limit)
            prefill = prefills[p]
            batch, rest = pd.split_for_pool(batch, prefill.free_blocks)
            if rest is not None:
                self.buckets.requeue(rest)
            if batch is None:  # wait for handoffs to be acknowledged
                break
            states = self._take(batch, decode, "prefill", "remote")
            queued = pd.uncached_blocks(pd.prefill_cache, prefill.name, batch)
            pd.prefill_sent(prefill.name, queued)
            pd.dispatched(batch, self._decode_number(decode), prefill.name)
            handoff = Handoff(
                prefill,
                decode,
                pd.need(batch),
                pd.decode_need(batch),
                self.config.lease_ttl_s,
                pd.fork_blocks(batch),
            )
            flights.append(self._handoff(handoff, batch, states, queued))
        return flights

    def _dispatch_colocated(self) -> list[Flight]:
        """Colocated shape: each batch goes straight to the engine of the decode worker with
        the most room (or the one caching its prompts), which prefills it within its decode
        steps."""
        flights = []
        while len(self.buckets):
            decode = self.pick_decode()
            if decode is None:
                break
            batch = self._next_batch(decode)
            if batch is None:
                break
            decode = self._place_decode(batch, decode)
            flights.append(self._prefill_locally(decode, batch))
        return flights

    def _prefill_locally(self, decode: WorkerHandle, batch: PrefillBatch) -> Flight:
        """`batch` to `decode`'s engine, which prefills it within its decode steps."""
        states = self._take(batch, decode, "decode", "local")
        self.pd.dispatched(batch, self._decode_number(decode))
        blocks = sum(n for _, n in self.pd.need(batch)) + self.pd.fork_blocks(batch)
        return self._admit_prompts(decode, states, blocks)

    def _path_costs(
        self, decode: WorkerHandle, prefills: list[WorkerHandle], open_: int | None
    ) -> PathCosts:
        """What each path costs `decode`'s next batch now, from the workers' last reports
        and the KV moved so far (`PathCosts`)."""
        reports = [h.stats for h in prefills if h.stats is not None]
        measured = [r.prefill_token_s for r in reports if r.prefill_token_s is not None]
        queued = sum(self.pd.prefill_queued.values()) * self.limits.block_size
        kv_format = self.pool.infos.get(decode.name, {}).get("kv_format")
        moved = self.monitor.counts["kv_bytes"]
        token_s = 0.0
        if kv_format is not None and moved:
            per_token = kv_format.chunk_bytes(1) * kv_format.num_layers / kv_format.block_size
            token_s = self.monitor.transfer_s / moved * per_token
        stats = decode.stats
        return PathCosts(
            prefill_token_s=sum(measured) / len(measured) if measured else None,
            prefill_backlog_tokens=queued / max(1, len(prefills)),
            prefill_open=open_ is not None,
            transfer_token_s=token_s,
            layerwise=stats is not None and stats.transport in LAYERWISE,
            num_layers=kv_format.num_layers if kv_format is not None else 1,
            handoff_s=self.handoff_s or 0.0,
            decode_token_s=stats.prefill_token_s if stats else None,
            decode_step_s=(stats.decode_step_s or 0.0) if stats else 0.0,
            decode_backlog_tokens=stats.prompt_tokens_to_come if stats else 0,
            decode_running=stats.running if stats else 0,
            step_tokens=self.config.decode.max_num_batched_tokens,
        )

    def pick_decode(self) -> WorkerHandle | None:
        """The decode worker the next batch reserves blocks on: the PDScheduler's choice over
        every live decode worker's room and load as last reported."""
        decodes = self.pool.role("decode")
        self._forget_past_lives(decodes, self.pd.decode_cache, lambda i, h: i)
        for i, handle in enumerate(decodes):
            if handle.alive:
                self.pd.update(i, handle.free_blocks, handle.load)
            else:
                self.pd.remove(i)
        i = self.pd.pick_decode()
        return None if i is None else decodes[i]

    def _place_decode(self, batch: PrefillBatch, decode: WorkerHandle) -> WorkerHandle:
        """The decode worker `batch` goes to: `decode` (the most room), or one with room for
        it whose cache holds more of its prompts (the PDScheduler's placement)."""
        min_room = self.buckets.controller.room_for(batch.kv_blocks)
        i = self.pd.place_decode(batch, min_room)
        return decode if i is None else self.pool.role("decode")[i]

    def _decode_number(self, decode: WorkerHandle) -> int:
        return self.pool.role("decode").index(decode)

    def _forget_past_lives(
        self,
        handles: list[WorkerHandle],
        index: PrefixIndex,
        key: Callable[[int, WorkerHandle], Hashable],
    ) -> None:
        """A worker that died since it was last seen lost its cache; each caches at most its
        pool's blocks."""
        for i, handle in enumerate(handles):
            if self._epochs.get(handle.name, handle.epoch) != handle.epoch:
                index.clear(key(i, handle))
            self._epochs[handle.name] = handle.epoch
            if handle.stats is not None:
                index.set_capacity(key(i, handle), handle.stats.num_total_blocks)

    def _next_batch(self, decode: WorkerHandle) -> PrefillBatch[RequestState] | None:
        return self.buckets.next_batch(decode.free_blocks, self.limits.block_size, time.monotonic())

    def _take(
        self, batch: PrefillBatch[RequestState], decode: WorkerHandle, phase: str, path: str
    ) -> list[RequestState]:
        """The batch's requests (each queued entry carries its RequestState), now in `phase`
        on their way to `decode`, prefilled on `path` (local: by `decode` itself)."""
        states = [r.item for r in batch.requests]
        now = time.monotonic()
        for state in states:
            state.phase, state.decode_worker = phase, decode.name
            state.dispatched_at = state.dispatched_at or now
            state.request_bucket, state.shape_bucket = batch.bucket, batch.shape
            state.prefill_path = path
        self.monitor.prefill_paths[path] += len(states)
        return states

    def _worker_request(self, state: RequestState) -> WorkerRequest:
        """`state` as a worker's engine takes it: ranked by its tenant's priority, then its
        own, as the bucket manager ranks it; due by its (or its tenant's) TTFT target."""
        return state.worker_request(self._tenant(state))

    def _tenant(self, state: RequestState) -> TenantConfig:
        return self.buckets.tenants[state.request.tenant].config

    # -- colocated: one call -----------------------------------------------------------------

    async def _admit_prompts(
        self, decode: WorkerHandle, states: list[RequestState], blocks: int
    ) -> Flight:
        """Add a batch to `decode`'s engine, in the order the bucket manager formed it; its
        blocks count as taken until the worker's answer (whose stats count them among its
        waiting requests' needs)."""
        epoch = decode.epoch
        decode.pending_blocks += blocks
        try:
            requests = [self._worker_request(s) for s in states]
            result = await decode.call("admit_prompts", requests)
        except Exception as exc:
            for state in states:
                yield Requeue(state, f"{decode.name} failed: {exc}")
            yield Failure(decode, exc, epoch)
            return
        finally:
            if decode.epoch == epoch:
                decode.pending_blocks -= blocks
            self.wake()
        if result.stats is not None:
            decode.stats = result.stats
        for state in states:
            if state.request_id in result.rejected:
                yield FailRequest(state, result.rejected[state.request_id])
            elif state.done:  # cancelled while it was being added
                yield AbortOnWorker(decode, state.request_id)

    # -- disaggregated: the handoff's outcomes -----------------------------------------------

    async def _handoff(
        self, handoff: Handoff, batch: PrefillBatch, states: list[RequestState], queued: int
    ) -> Flight:
        """Drive `handoff`; the outcomes of each step it returns. `queued`: the blocks the
        prefill worker computes for it, queued there until its prefill ends."""
        try:
            start = time.monotonic()
            try:
                requests = [self._worker_request(s) for s in states]
                prefilled = await handoff.run_prefill(batch, requests, self.limits.max_seq_len)
            finally:
                self.pd.prefill_done(handoff.prefill.name, queued)
            if prefilled.result is not None:  # what the calls took beyond compute and KV
                r = prefilled.result
                spent = max(0.0, time.monotonic() - start - r.compute_s - r.send_s)
                self.handoff_s = moving_average(self.handoff_s, spent)
            if prefilled.result is None:
                if prefilled.put_back:
                    for outcome in self.put_back(batch, prefilled.count):
                        yield outcome
                for failure in prefilled.failures:
                    yield failure
                if prefilled.poll is not None:
                    for failure in await self.pool.poll(prefilled.poll):
                        yield failure
                return
            for outcome in self._prefilled(states, prefilled.result):
                yield outcome
            if handoff.reservation is None:  # every request ended at its first token
                return
            live = [s for s in states if s.phase == "prefill"]
            admitted = await handoff.admit([self._worker_request(s) for s in live])
            for outcome in self._admitted(handoff.decode, live, admitted):
                yield outcome
        finally:
            handoff.close()
            self.wake()


    def _prefilled(self, states: list[RequestState], result: PrefillResult) -> Iterator[Outcome]:
        """Each first token for its stream (those of requests still going)."""
        if result.lease_id is not None:  # some KV went out
            self.monitor.sent(result.kv_bytes, result.send_s)
        for state, first in zip(states, result.first, strict=True):
            state.prefill_s += result.compute_s
            state.transfer_s += result.send_s
            if not state.done:
                yield Deliver(state, first)

    def _admitted(
        self, decode: WorkerHandle, live: list[RequestState], admitted: Admitted
    ) -> Iterator[Outcome]:
        """Requests admitted start decoding; those rejected end, those cancelled meanwhile
        (or ended at prefill by a stop string, sample 0 of n) are aborted on `decode`; with
        no admission every one is re-queued."""
        ack = admitted.ack
        if ack is None:
            for state in live:
                yield Requeue(state, admitted.why)
        yield from admitted.failures
        if ack is None:
            return
        self.monitor.received(ack.receive_s)
        for state in live:
            state.transfer_s += ack.receive_s
            if state.request_id in ack.rejected:
                yield FailRequest(state, ack.rejected[state.request_id])
            elif state.done:  # cancelled while it was handed over
                yield AbortOnWorker(decode, state.request_id)
            else:
                state.phase = "decode"
                if state.n > 1 and state.ended[0]:  # a stop string ended sample 0 at prefill
                    yield AbortOnWorker(decode, state.request_id, 0)
