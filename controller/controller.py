"""The serving controller: bucket manager -> reserve -> prefill -> KV handoff -> decode -> stream.

    controller = Controller(ControllerConfig(mode="local"))
    await controller.start()
    async for delta in controller.submit(request):  # StreamDelta, the last one finished
        ...

Method groups: lifecycle (start, shutdown, drain, stats), the request table (submit,
abort), dispatch (the PDScheduler's choices, one Handoff per batch, acting on its
outcomes), the output pump (decode step messages through the OutputProcessor to the
RequestStreams), the fault policy (requeue, put back, judge failures, revive) and bounds
from the pools the workers got. Counting is the ServiceMonitor's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from bucket_manager.bucket_manager import BucketManager
from bucket_manager.prefill_batch import PrefillBatch
from controller.config import ControllerConfig
from controller.handoff import Admitted, Handoff
from controller.pd_scheduler import PDScheduler, subset
from controller.request_state import RequestState
from controller.request_stream import RequestStream
from controller.service_limits import ServiceLimits
from controller.service_monitor import ServiceMonitor
from controller.worker_handle import Failure, WorkerDiedError, WorkerHandle, WorkerHungError
from controller.worker_pool import WorkerPool
from decode_worker.decode_worker import WorkerFailedError
from kv_transfer.lease import LeaseError
from kv_transfer.transport import TransferError
from kv_worker.messages import (
    ModelInfo,
    NoWorkersError,
    PrefillResult,
    QueueFullError,
    ServeRequest,
    ServiceStats,
    StepOutput,
    TokenDelta,
)
from prefill_worker.prefill_worker import PrefillCapacityError
from runtime.output_processor import OutputProcessor

logger = logging.getLogger(__name__)

_DEATHS = (WorkerDiedError, WorkerFailedError)
_POLL_S = 0.5  # a decode worker's long-poll for step messages


class Controller:
    """Runs the P/D pipeline over P prefill and D decode workers (Ray actors or local).

    Requests queue in the BucketManager. The dispatcher takes a batch sized
    for the decode worker with the most room, has that worker *reserve* the
    blocks its KV needs (a lease), sends the batch to the least busy prefill
    worker, streams the first tokens, and admits the prefilled sequences on
    the decode worker, whose step messages carry every later token. A dead
    decode worker's requests are re-prefilled elsewhere with the tokens they
    had streamed (never sent twice); a dead prefill worker's batch is retried.
    All of this runs on the caller's asyncio loop; call `submit` from it.
    """

    def __init__(self, config: ControllerConfig | None = None) -> None:
        self.config = config = config or ControllerConfig()
        self.limits = limits = ServiceLimits(config)
        self.block_size = limits.block_size
        self.buckets = BucketManager(limits.buckets)
        self.pool = WorkerPool(config, limits.buckets)
        self.pd = PDScheduler(config.num_decode, limits.block_size)
        self.outputs = OutputProcessor(limits.model.tokenizer)  # text and stop strings
        self._requests: dict[str, RequestState] = {}
        self._tasks: set[asyncio.Task] = set()
        self._wake: asyncio.Event | None = None
        self._state = "new"
        self.monitor = ServiceMonitor()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self.limits.model

    async def start(self) -> None:
        """Start Ray (or the local workers), create and warm up every worker."""
        if self._state != "new":
            raise RuntimeError(f"start() runs once; the controller is {self._state}")
        self._state = "starting"
        self._wake = asyncio.Event()
        try:
            await self.pool.start()
        except BaseException:
            self._state = "stopped"
            await self.pool.shutdown()
            raise
        self._bound_by_pools()
        self._state = "running"
        self._spawn(self._dispatch_loop())
        self._spawn(self._monitor_loop())
        for handle in self.pool.role("decode"):
            self._spawn(self._pump(handle))

    async def shutdown(self) -> None:
        """End every live request (final delta with an error), stop the workers."""
        if self._state in ("stopping", "stopped"):
            return
        self._state = "stopping"
        for state in list(self._requests.values()):
            self._finish(state, "error", "the service is shutting down")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.shutdown()
        self._state = "stopped"

    async def __aenter__(self) -> Controller:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # -- requests ----------------------------------------------------------------------------

    def submit(self, request: ServeRequest) -> RequestStream:
        """Queue `request`; its deltas come out of the returned async iterator, the last with
        `finished=True`. The request was validated at the edge (the gateway's admission);
        raises (queuing nothing) ValueError for an id in use or a tenant the bucket manager
        does not serve, QueueFullError at the queue bound, NoWorkersError without live
        workers."""
        if self._state != "running":
            raise NoWorkersError(f"the controller is {self._state}; call start() first")
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if len(self.buckets) >= self.config.max_queued_requests:
            raise QueueFullError(
                f"{len(self.buckets)} requests are queued, the bound is "
                f"{self.config.max_queued_requests}; retry later",
                retry_after_s=1.0,
            )
        if not self.pool.serving():
            raise NoWorkersError("no live prefill or decode worker; retry once they restart")
        state = RequestState(request, RequestStream(request.request_id, self.abort))
        self.buckets.add(state.bucket_request(self._max_tokens_hint(state)))
        params = request.sampling_params
        for i in range(state.n):
            sample = params if state.n == 1 else params.sample(i)
            self.outputs.add(state.key(i), request.prompt_token_ids, sample)
        self._requests[request.request_id] = state
        self.monitor.submitted()
        self._wake_dispatcher()
        return state.stream

    async def abort(self, request_id: str) -> bool:
        """Cancel a request: its final delta says `cancelled` and its KV blocks are freed
        (a reservation whose prefill is under way: as soon as that prefill returns)."""
        state = self._requests.get(request_id)
        if state is None or state.done:
            return False
        phase, worker = state.phase, state.decode_worker
        self._finish(state, "cancelled")
        if phase == "decode":
            handle = self.pool.by_name(worker)
            try:
                await handle.call("abort", request_id)
            except Exception as exc:  # a dead worker freed everything anyway
                logger.info("abort of %s on %s failed: %s", request_id, worker, exc)
        return True

    def stats(self) -> ServiceStats:
        running = sum(1 for s in self._requests.values() if s.phase in ("prefill", "decode"))
        restarts = sum(h.restarts for h in self.pool.handles)
        return self.monitor.stats(
            len(self.buckets), running, self.pool.worker_stats(), self.buckets.snapshot(), restarts
        )

    async def drain(self, timeout_s: float = 120.0) -> ServiceStats:
        """Wait until every request has finished and every worker reports its blocks free
        and its leases closed (or `timeout_s` passes); the fresh stats."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._requests and loop.time() < deadline:
            await asyncio.sleep(0.02)
        while loop.time() < deadline:
            await self.refresh_stats()
            stats = self.stats()
            if stats.kv_blocks_leaked == 0 and stats.leases_open == 0:
                break
            await asyncio.sleep(0.05)
        return self.stats()

    def serving(self) -> bool:
        """Running, with a live worker for every phase (health checks say so)."""
        return self._state == "running" and self.pool.serving()

    async def refresh_stats(self) -> None:
        self._judge(await self.pool.refresh())

    async def kill_worker(self, name: str) -> None:
        """Fault drill: kill a worker as a crash would (Ray restarts it, local rebuilds it)."""
        await self.pool.by_name(name).kill()

    # -- dispatch ----------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._dispatch()

    def _dispatch(self) -> None:
        """Form and send batches while a prefill worker has a free slot and a decode worker
        has room for the next batch; the PDScheduler makes each choice."""
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
            batch = self.buckets.next_batch(decode.free_blocks, self.block_size, time.monotonic())
            if batch is None:
                return
            batch, rest = pd.split_for_pool(batch, prefill.free_blocks)
            if rest is not None:
                self.buckets.requeue(rest)
            if batch is None:  # wait for handoffs to be acknowledged
                return
            states = self._take(batch, decode, "prefill")
            handoff = Handoff(
                prefill, decode, pd.need(batch), self.config.lease_ttl_s, pd.fork_blocks(batch)
            )
            self._spawn(self._handoff(handoff, batch, states))

    def _dispatch_colocated(self) -> None:
        """Colocated shape: each batch goes straight to the engine of the decode worker with
        the most room, which prefills it within its decode steps."""
        while len(self.buckets):
            decode = self.pick_decode()
            if decode is None:
                return
            batch = self.buckets.next_batch(decode.free_blocks, self.block_size, time.monotonic())
            if batch is None:
                return
            states = self._take(batch, decode, "decode")
            blocks = sum(n for _, n in self.pd.need(batch)) + self.pd.fork_blocks(batch)
            self._spawn(self._colocate(decode, states, blocks))

    def _take(self, batch: PrefillBatch, decode: WorkerHandle, phase: str) -> list[RequestState]:
        """The batch's requests, now in `phase` on their way to `decode`."""
        states = [self._requests[r.request_id] for r in batch.requests]
        now = time.monotonic()
        for state in states:
            state.phase, state.decode_worker = phase, decode.name
            state.dispatched_at = state.dispatched_at or now
            state.request_bucket, state.shape_bucket = batch.bucket, batch.shape
        return states

    async def _colocate(
        self, decode: WorkerHandle, states: list[RequestState], blocks: int
    ) -> None:
        """Add a batch to `decode`'s engine; its blocks count as taken until the worker's
        answer (whose stats count them among its waiting requests' needs)."""
        epoch = decode.epoch
        decode.pending_blocks += blocks
        try:
            result = await decode.call("add_requests", [s.handoff() for s in states])
        except Exception as exc:
            for state in states:
                self._requeue(state, f"{decode.name} failed: {exc}")
            self._on_failure(decode, exc, epoch)
            return
        finally:
            if decode.epoch == epoch:
                decode.pending_blocks -= blocks
            self._wake_dispatcher()
        if result.stats is not None:
            decode.stats = result.stats
        for state in states:
            if state.request_id in result.rejected:
                self._finish(state, "error", result.rejected[state.request_id])
            elif state.done:  # cancelled while it was being added
                await self._abort_on(decode, state.request_id)

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

    async def _handoff(
        self, handoff: Handoff, batch: PrefillBatch, states: list[RequestState]
    ) -> None:
        """Drive `handoff` and act on each outcome it returns."""
        try:
            requests = [s.handoff() for s in states]
            prefilled = await handoff.run_prefill(batch, requests, self.limits.max_seq_len)
            if prefilled.result is None:
                if prefilled.put_back:
                    self._put_back(batch, prefilled.count)
                self._judge(prefilled.failures)
                if prefilled.poll is not None:
                    self._judge(await self.pool.poll(prefilled.poll))
                return
            self._prefilled(states, prefilled.result)
            live = [s for s in states if s.phase == "prefill"]
            admitted = await handoff.admit([s.handoff() for s in live])
            await self._admitted(handoff.decode, live, admitted)
        finally:
            handoff.close()
            self._wake_dispatcher()

    def _prefilled(self, states: list[RequestState], result: PrefillResult) -> None:
        self.monitor.sent(result.kv_bytes, result.send_s)
        for state, first in zip(states, result.first, strict=True):
            state.prefill_s += result.compute_s
            state.transfer_s += result.send_s
            if not state.done:
                self._deliver(state, first)

    async def _admitted(
        self, decode: WorkerHandle, live: list[RequestState], admitted: Admitted
    ) -> None:
        ack = admitted.ack
        if ack is None:
            for state in live:
                self._requeue(state, admitted.why)
        self._judge(admitted.failures)
        if ack is None:
            return
        self.monitor.received(ack.receive_s)
        for state in live:
            state.transfer_s += ack.receive_s
            if state.request_id in ack.rejected:
                self._finish(state, "error", ack.rejected[state.request_id])
            elif state.done:  # cancelled while it was handed over
                await self._abort_on(decode, state.request_id)
            else:
                state.phase = "decode"
                if state.n > 1 and state.ended[0]:  # a stop string ended sample 0 at prefill
                    await self._abort_on(decode, state.request_id, 0)

    # -- outputs -----------------------------------------------------------------------------

    async def _pump(self, decode: WorkerHandle) -> None:
        """Fetch one decode worker's step messages and fan their deltas out."""
        while True:
            if not decode.alive:
                await asyncio.sleep(0.05)
                continue
            epoch = decode.epoch
            try:
                messages = await decode.call("next_outputs", _POLL_S)
            except Exception as exc:
                self._on_failure(decode, exc, epoch)
                await asyncio.sleep(0.05)
                continue
            if decode.epoch == epoch:
                for message in messages:
                    self._on_step(decode, message)

    def _on_step(self, decode: WorkerHandle, message: StepOutput) -> None:
        if message.boot_id != decode.boot_id:
            return
        decode.stats = message.stats
        for delta in message.deltas:
            state = self._requests.get(delta.request_id)
            if state is not None and state.decode_worker == decode.name and not state.done:
                self._deliver(state, delta)
        self._wake_dispatcher()

    def _deliver(self, state: RequestState, delta: TokenDelta) -> None:
        phase = state.phase
        out = state.accept(delta, self.outputs)
        if out is None:
            return
        state.stream.put(out)
        if out.finish_reason is None:
            return
        if out.finished:
            self._closed(state, out.finish_reason)
        if phase == "decode" and not delta.finished:  # a stop string: the worker runs it still
            decode = self.pool.by_name(state.decode_worker)
            index = None if out.finished else out.index
            self._spawn(self._abort_on(decode, state.request_id, index))

    def _finish(self, state: RequestState, reason: str, error: str | None = None) -> None:
        if state.phase == "queued":
            self.buckets.remove(state.request_id)
        for delta in state.finals(reason, error):
            state.stream.put(delta)
        self._closed(state, reason)

    def _closed(self, state: RequestState, reason: str) -> None:
        self._requests.pop(state.request_id, None)
        for i in range(state.n):
            self.outputs.remove(state.key(i))
        self.monitor.finished(reason)

    # -- faults ------------------------------------------------------------------------------

    def _requeue(self, state: RequestState, why: str) -> None:
        """Queue a request again for a re-prefill of everything it has so far."""
        if state.done:
            return
        if state.n > 1 and any(state.samples):
            self._finish(state, "error", f"{why}; a request of n > 1 samples is not re-prefilled")
            return
        state.requeues += 1
        self.monitor.requeued()
        if state.requeues > self.config.max_requeues:
            self._finish(state, "error", f"gave up after {state.requeues - 1} re-prefills: {why}")
            return
        logger.warning("re-queuing %s: %s", state.request_id, why)
        state.phase, state.decode_worker = "queued", None
        self.buckets.add(state.bucket_request(self._max_tokens_hint(state)))
        self._wake_dispatcher()

    def _put_back(self, batch: PrefillBatch, count: bool) -> None:
        """A batch that never reached prefill goes back where its requests were."""
        keep = []
        for i, request in enumerate(batch.requests):
            state = self._requests.get(request.request_id)
            if state is None or state.done:
                continue
            state.phase, state.decode_worker = "queued", None
            if count:
                state.requeues += 1
                if state.requeues > self.config.max_requeues:
                    self._finish(state, "error", "its prefill failed too often")
                    continue
            keep.append(i)
        if keep:
            self.buckets.requeue(subset(batch, keep))
        self._wake_dispatcher()

    def _judge(self, failures: list[Failure]) -> None:
        for failure in failures:
            self._on_failure(failure.handle, failure.error, failure.epoch)

    def _on_failure(self, handle: WorkerHandle, exc: BaseException, epoch: int) -> None:
        if not isinstance(exc, _DEATHS):
            if not isinstance(exc, (LeaseError, TransferError, PrefillCapacityError)):
                logger.error("%s failed a call: %r", handle.name, exc)
            return
        if handle.epoch != epoch or not handle.mark_dead():
            return
        logger.warning("%s died (%s); restarting it", handle.name, exc)
        if handle.role == "decode":
            for state in list(self._requests.values()):
                if state.decode_worker == handle.name and state.phase == "decode":
                    self._requeue(state, f"{handle.name} died")
        hung_or_failed = isinstance(exc, (WorkerFailedError, WorkerHungError))
        self._spawn(self._revive(handle, kill_first=hung_or_failed))

    async def _revive(self, handle: WorkerHandle, kill_first: bool) -> None:
        try:
            if kill_first:
                await handle.kill()
            await self.pool.revive(handle)
        except Exception:
            logger.exception("%s could not be restarted", handle.name)
            if not self.pool.role(handle.role, alive=True):
                for state in list(self._requests.values()):
                    self._finish(state, "error", f"no live {handle.role} worker is left")
        self._wake_dispatcher()

    # -- helpers -----------------------------------------------------------------------------

    async def _abort_on(
        self, decode: WorkerHandle, request_id: str, index: int | None = None
    ) -> None:
        try:
            await decode.call("abort", request_id, index)
        except Exception as exc:
            self._on_failure(decode, exc, decode.epoch)

    async def _monitor_loop(self) -> None:
        """The global monitor: fresh worker reports, and deaths of idle workers noticed."""
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            await self.refresh_stats()
            self._wake_dispatcher()

    def _bound_by_pools(self) -> None:
        """Bounds from the pools the workers got; prefill workers that run every batch at its
        own shape (no padding: the CPU) take batches past the warmed batch sizes, up to
        `max_num_seqs` and `max_batched_tokens`. Colocated, the decode workers prefill,
        unpadded, in chunks."""
        prefills = self.pool.role("decode" if self.config.colocated else "prefill")
        decode = min(h.stats.num_total_blocks for h in self.pool.role("decode") if h.stats)
        prefill = min(h.stats.num_total_blocks for h in prefills if h.stats)
        self.limits.bound_by_pools(decode, prefill, self.buckets.controller.safe_blocks(decode))
        infos = self.pool.infos
        padded = any(infos[h.name].get("padding", True) for h in self.pool.role("prefill"))
        if self.config.colocated or not padded:
            self.buckets = BucketManager(self.buckets.config, self.buckets.shapes, padded=False)

    def _max_tokens_hint(self, state: RequestState) -> int:
        """Per sample: n samples' growth must fit the pool together."""
        left = state.request.sampling_params.max_tokens - len(state.output_token_ids)
        hint = self.limits.max_tokens_hint(left, state.num_tokens)
        return hint if state.n == 1 else max(1, hint // state.n)

    def _wake_dispatcher(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("controller task failed", exc_info=task.exception())

