"""Dispatch, both deployment shapes: queued requests -> PDScheduler choices -> batches on their
way to a decode worker, through a Handoff (disaggregated) or straight into its engine
(colocated).

The Dispatcher owns the queue side of a request's life (the BucketManager, the PDScheduler,
queuing, putting a batch back, the phase a request is in on its way). Each batch it sends
is a `Flight`: the outcomes of its way, in order, which the Controller applies to the
request table, the output streams and its fault policy (`outcomes.py`), as the Handoff
returns its own outcomes to the Dispatcher.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

from bucketserve.bucket_manager.bucket_manager import BucketManager
from bucketserve.bucket_manager.prefill_batch import PrefillBatch
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
from bucketserve.controller.pd_scheduler import PDScheduler, subset
from bucketserve.controller.request_state import RequestState
from bucketserve.controller.service_limits import ServiceLimits
from bucketserve.controller.service_monitor import ServiceMonitor
from bucketserve.controller.worker_handle import Failure, WorkerHandle
from bucketserve.controller.worker_pool import WorkerPool
from bucketserve.messages import PrefillResult, WorkerRequest


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
        self.buckets = BucketManager(limits.buckets)
        self.pd = PDScheduler(config.num_decode, limits.block_size)
        self._wake = asyncio.Event()

    # -- the queue ---------------------------------------------------------------------------

    def queue(self, state: RequestState) -> None:
        """Queue `state` for a prefill of everything it has so far."""
        state.phase, state.decode_worker = "queued", None
        left = state.request.sampling_params.max_tokens - len(state.output_token_ids)
        hint = self.limits.max_tokens_hint(left, state.num_tokens)
        if state.n > 1:  # per sample: n samples' growth must fit the pool together
            hint = max(1, hint // state.n)
        self.buckets.add(state.bucket_request(hint))
        self.wake()

    def put_back(self, batch: PrefillBatch, count: bool) -> list[Outcome]:
        """A batch that never reached prefill goes back where its requests were; those that
        have failed too often (`count`: this was a failed try) end instead."""
        keep, ended = [], []
        for i, request in enumerate(batch.requests):
            state: RequestState = request.payload
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
        pd, flights = self.pd, []
        while len(self.buckets):
            prefills = self.pool.role("prefill", alive=True)
            p = pd.pick_prefill(
                [h.free_blocks for h in prefills],
                [h.inflight for h in prefills],
                self.config.max_batches_per_prefill,
            )
            decode = self.pick_decode()
            if p is None or decode is None:
                break
            prefill = prefills[p]
            batch = self._next_batch(decode)
            if batch is None:
                break
            batch, rest = pd.split_for_pool(batch, prefill.free_blocks)
            if rest is not None:
                self.buckets.requeue(rest)
            if batch is None:  # wait for handoffs to be acknowledged
                break
            states = self._take(batch, decode, "prefill")
            handoff = Handoff(
                prefill,
                decode,
                pd.need(batch),
                pd.decode_need(batch),
                self.config.lease_ttl_s,
                pd.fork_blocks(batch),
            )
            flights.append(self._handoff(handoff, batch, states))
        return flights

    def _dispatch_colocated(self) -> list[Flight]:
        """Colocated shape: each batch goes straight to the engine of the decode worker with
        the most room, which prefills it within its decode steps."""
        flights = []
        while len(self.buckets):
            decode = self.pick_decode()
            if decode is None:
                break
            batch = self._next_batch(decode)
            if batch is None:
                break
            states = self._take(batch, decode, "decode")
            blocks = sum(n for _, n in self.pd.need(batch)) + self.pd.fork_blocks(batch)
            flights.append(self._admit_prompts(decode, states, blocks))
        return flights

    def pick_decode(self) -> WorkerHandle | None:
        """The decode worker the next batch reserves blocks on: the PDScheduler's choice over
        every live decode worker's room and load as last reported."""
        decodes = self.pool.role("decode")
        for i, handle in enumerate(decodes):
            if handle.alive:
                self.pd.update(i, handle.free_blocks, handle.load)
            else:
                self.pd.remove(i)
        i = self.pd.pick_decode()
        return None if i is None else decodes[i]

    def _next_batch(self, decode: WorkerHandle) -> PrefillBatch | None:
        return self.buckets.next_batch(decode.free_blocks, self.limits.block_size, time.monotonic())

    @staticmethod
    def _take(batch: PrefillBatch, decode: WorkerHandle, phase: str) -> list[RequestState]:
        """The batch's requests (each queued entry carries its RequestState), now in `phase`
        on their way to `decode`."""
        states: list[RequestState] = [r.payload for r in batch.requests]
        now = time.monotonic()
        for state in states:
            state.phase, state.decode_worker = phase, decode.name
            state.dispatched_at = state.dispatched_at or now
            state.request_bucket, state.shape_bucket = batch.bucket, batch.shape
        return states

    def _worker_request(self, state: RequestState) -> WorkerRequest:
        """`state` as a worker's engine takes it: ranked by its tenant's priority, then its
        own, as the bucket manager ranks it; due by its (or its tenant's) TTFT target."""
        return state.worker_request(self.buckets.tenants[state.request.tenant].config)

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
        self, handoff: Handoff, batch: PrefillBatch, states: list[RequestState]
    ) -> Flight:
        """Drive `handoff`; the outcomes of each step it returns."""
        try:
            requests = [self._worker_request(s) for s in states]
            prefilled = await handoff.run_prefill(batch, requests, self.limits.max_seq_len)
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
