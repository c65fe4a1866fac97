"""Dispatch, both deployment shapes: queued requests -> PDScheduler choices -> batches on their
way to a decode worker, through a Handoff (disaggregated) or straight into its engine
(colocated); acting on each outcome the Handoff returns.

The Dispatcher owns the queue side of a request's life (the BucketManager, the PDScheduler,
queuing, re-queuing, putting a batch back); the request table, the output stream and the
fault policy stay the Controller's, reached through `DispatchOwner`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any, Protocol

from bucketserve.bucket_manager.bucket_manager import BucketManager
from bucketserve.bucket_manager.prefill_batch import PrefillBatch
from bucketserve.controller.config import ControllerConfig
from bucketserve.controller.handoff import Admitted, Handoff
from bucketserve.controller.pd_scheduler import PDScheduler, subset
from bucketserve.controller.request_state import RequestState
from bucketserve.controller.service_limits import ServiceLimits
from bucketserve.controller.service_monitor import ServiceMonitor
from bucketserve.controller.worker_handle import Failure, WorkerHandle
from bucketserve.controller.worker_pool import WorkerPool
from bucketserve.messages import HandoffRequest, PrefillResult, TokenDelta

logger = logging.getLogger(__name__)


class DispatchOwner(Protocol):
    """What dispatch needs of the Controller: the request table and the fault policy."""

    def deliver(self, state: RequestState, delta: TokenDelta) -> None: ...

    def finish(self, state: RequestState, reason: str, error: str | None = None) -> None: ...

    def judge(self, failures: list[Failure]) -> None: ...

    def on_failure(self, handle: WorkerHandle, exc: BaseException, epoch: int) -> None: ...

    async def abort_on(
        self, decode: WorkerHandle, request_id: str, index: int | None = None
    ) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...


class Dispatcher:
    """Forms and sends batches while a prefill worker has a free slot (colocated: none is
    needed) and a decode worker has room; the PDScheduler makes each choice. Woken by
    `wake()` whenever room, slots or queued requests may have changed."""

    def __init__(
        self,
        owner: DispatchOwner,
        config: ControllerConfig,
        limits: ServiceLimits,
        pool: WorkerPool,
        monitor: ServiceMonitor,
    ) -> None:
        self.owner = owner
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
        left = state.request.sampling_params.max_tokens - len(state.output_token_ids)
        hint = self.limits.max_tokens_hint(left, state.num_tokens)
        if state.n > 1:  # per sample: n samples' growth must fit the pool together
            hint = max(1, hint // state.n)
        self.buckets.add(state.bucket_request(hint))
        self.wake()

    def requeue(self, state: RequestState, why: str) -> None:
        """Queue a request again for a re-prefill of everything it has so far."""
        if state.done:
            return
        if state.n > 1 and any(state.samples):
            self.owner.finish(
                state, "error", f"{why}; a request of n > 1 samples is not re-prefilled"
            )
            return
        state.requeues += 1
        self.monitor.requeued()
        if state.requeues > self.config.max_requeues:
            self.owner.finish(
                state, "error", f"gave up after {state.requeues - 1} re-prefills: {why}"
            )
            return
        logger.warning("re-queuing %s: %s", state.request_id, why)
        state.phase, state.decode_worker = "queued", None
        self.queue(state)

    def put_back(self, batch: PrefillBatch, count: bool) -> None:
        """A batch that never reached prefill goes back where its requests were."""
        keep = []
        for i, request in enumerate(batch.requests):
            state: RequestState = request.payload
            if state.done:
                continue
            state.phase, state.decode_worker = "queued", None
            if count:
                state.requeues += 1
                if state.requeues > self.config.max_requeues:
                    self.owner.finish(state, "error", "its prefill failed too often")
                    continue
            keep.append(i)
        if keep:
            self.buckets.requeue(subset(batch, keep))
        self.wake()

    # -- the loop ----------------------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self.dispatch()

    def dispatch(self) -> None:
        if self.config.colocated:
            self._dispatch_colocated()
            return
        pd = self.pd
        while len(self.buckets):
            prefills = self.pool.role("prefill", alive=True)
            p = pd.pick_prefill(
                [h.free_blocks for h in prefills],
                [h.inflight for h in prefills],
                self.config.max_batches_per_prefill,
            )
            decode = self.pick_decode()
            if p is None or decode is None:
                return
            prefill = prefills[p]
            batch = self._next_batch(decode)
            if batch is None:
                return
            batch, rest = pd.split_for_pool(batch, prefill.free_blocks)
            if rest is not None:
                self.buckets.requeue(rest)
            if batch is None:  # wait for handoffs to be acknowledged
                return
            states = self._take(batch, decode, "prefill")
            handoff = Handoff(
                prefill,
                decode,
                pd.need(batch),
                pd.decode_need(batch),
                self.config.lease_ttl_s,
                pd.fork_blocks(batch),
            )
            self.owner.spawn(self._handoff(handoff, batch, states))

    def _dispatch_colocated(self) -> None:
        """Colocated shape: each batch goes straight to the engine of the decode worker with
        the most room, which prefills it within its decode steps."""
        while len(self.buckets):
            decode = self.pick_decode()
            if decode is None:
                return
            batch = self._next_batch(decode)
            if batch is None:
                return
            states = self._take(batch, decode, "decode")
            blocks = sum(n for _, n in self.pd.need(batch)) + self.pd.fork_blocks(batch)
            self.owner.spawn(self._colocate(decode, states, blocks))

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

    def _handoff_of(self, state: RequestState) -> HandoffRequest:
        """`state` as a decode worker's engine takes it: ranked by its tenant's priority,
        due by its (or its tenant's) TTFT target."""
        return state.handoff(self.buckets.tenants[state.request.tenant].config)

    # -- colocated: one call -----------------------------------------------------------------

    async def _colocate(
        self, decode: WorkerHandle, states: list[RequestState], blocks: int
    ) -> None:
        """Add a batch to `decode`'s engine; its blocks count as taken until the worker's
        answer (whose stats count them among its waiting requests' needs)."""
        owner, epoch = self.owner, decode.epoch
        decode.pending_blocks += blocks
        try:
            result = await decode.call("add_requests", [self._handoff_of(s) for s in states])
        except Exception as exc:
            for state in states:
                self.requeue(state, f"{decode.name} failed: {exc}")
            owner.on_failure(decode, exc, epoch)
            return
        finally:
            if decode.epoch == epoch:
                decode.pending_blocks -= blocks
            self.wake()
        if result.stats is not None:
            decode.stats = result.stats
        for state in states:
            if state.request_id in result.rejected:
                owner.finish(state, "error", result.rejected[state.request_id])
            elif state.done:  # cancelled while it was being added
                await owner.abort_on(decode, state.request_id)

    # -- disaggregated: the handoff's outcomes -----------------------------------------------

    async def _handoff(
        self, handoff: Handoff, batch: PrefillBatch, states: list[RequestState]
    ) -> None:
        """Drive `handoff` and act on each outcome it returns."""
        owner = self.owner
        try:
            requests = [s.handoff() for s in states]
            prefilled = await handoff.run_prefill(batch, requests, self.limits.max_seq_len)
            if prefilled.result is None:
                if prefilled.put_back:
                    self.put_back(batch, prefilled.count)
                owner.judge(prefilled.failures)
                if prefilled.poll is not None:
                    owner.judge(await self.pool.poll(prefilled.poll))
                return
            self._prefilled(states, prefilled.result)
            if handoff.reservation is None:  # every request ended at its first token
                return
            live = [s for s in states if s.phase == "prefill"]
            admitted = await handoff.admit([self._handoff_of(s) for s in live])
            await self._admitted(handoff.decode, live, admitted)
        finally:
            handoff.close()
            self.wake()

    def _prefilled(self, states: list[RequestState], result: PrefillResult) -> None:
        if result.lease_id is not None:  # some KV went out
            self.monitor.sent(result.kv_bytes, result.send_s)
        for state, first in zip(states, result.first, strict=True):
            state.prefill_s += result.compute_s
            state.transfer_s += result.send_s
            if not state.done:
                self.owner.deliver(state, first)

    async def _admitted(
        self, decode: WorkerHandle, live: list[RequestState], admitted: Admitted
    ) -> None:
        owner, ack = self.owner, admitted.ack
        if ack is None:
            for state in live:
                self.requeue(state, admitted.why)
        owner.judge(admitted.failures)
        if ack is None:
            return
        self.monitor.received(ack.receive_s)
        for state in live:
            state.transfer_s += ack.receive_s
            if state.request_id in ack.rejected:
                owner.finish(state, "error", ack.rejected[state.request_id])
            elif state.done:  # cancelled while it was handed over
                await owner.abort_on(decode, state.request_id)
            else:
                state.phase = "decode"
                if state.n > 1 and state.ended[0]:  # a stop string ended sample 0 at prefill
                    await owner.abort_on(decode, state.request_id, 0)
