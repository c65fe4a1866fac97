"""The serving controller: bucket manager -> reserve -> prefill -> KV handoff -> decode -> stream.

    controller = Controller(ControllerConfig(mode="local"))
    await controller.start()
    async for delta in controller.submit(request):  # StreamDelta, the last one finished
        ...

One job per method group: lifecycle (start, shutdown, drain, stats), the request table
(submit, abort, deliver, finish), the output pump (decode step messages through the
OutputProcessor to the RequestStreams) and the fault policy (judge failures, revive, re-queue
a dead worker's requests), applying the outcomes each dispatched batch's flight returns
(`outcomes.py`). Dispatch is the Dispatcher's (`dispatcher.py`), counting the
ServiceMonitor's, lengths and bounds the ServiceLimits'.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from contextlib import aclosing
from typing import Any

from bucketserve.bucket_manager.bucket_manager import BucketManager
from bucketserve.bucket_manager.request import BucketRequest
from bucketserve.controller.config import ControllerConfig
from bucketserve.controller.dispatcher import Dispatcher
from bucketserve.controller.outcomes import (
    AbortOnWorker,
    Deliver,
    FailRequest,
    Flight,
    Outcome,
    Requeue,
)
from bucketserve.controller.request_state import RequestState
from bucketserve.controller.request_stream import RequestStream
from bucketserve.controller.service_limits import ServiceLimits
from bucketserve.controller.service_monitor import ServiceMonitor
from bucketserve.controller.worker_handle import (
    Failure,
    WorkerDiedError,
    WorkerHandle,
    WorkerHungError,
)
from bucketserve.controller.worker_pool import WorkerPool
from bucketserve.kv_transfer.lease import LeaseError
from bucketserve.kv_transfer.transport import TransferError
from bucketserve.kv_worker.kv_worker import WorkerFailedError
from bucketserve.messages import (
    ModelInfo,
    NoWorkersError,
    QueueFullError,
    ServeRequest,
    ServiceStats,
    SloShedError,
    StepOutput,
    TokenDelta,
)
from bucketserve.prefill_worker.prefill_worker import PrefillCapacityError
from bucketserve.runtime.core.output_processor import OutputProcessor

logger = logging.getLogger(__name__)

_DEATHS = (WorkerDiedError, WorkerFailedError)
_POLL_S = 0.5  # a decode worker's long-poll for step messages


class Controller:
    """Runs the P/D pipeline over P prefill and D decode workers (Ray actors or local).

    Requests queue in the BucketManager. The Dispatcher takes a batch sized
    for the decode worker with the most room, has that worker *reserve* the
    blocks its KV needs (a lease), sends the batch to the least busy prefill
    worker, streams the first tokens, and admits the prefilled sequences on
    the decode worker, whose step messages carry every later token (colocated, the
    batch goes straight into that worker's engine, which prefills it). A dead
    decode worker's requests are re-prefilled elsewhere with the tokens they
    had streamed (never sent twice); a dead prefill worker's batch is retried.
    All of this runs on the caller's asyncio loop; call `submit` from it.
    """

    def __init__(self, config: ControllerConfig | None = None) -> None:
        self.config = config = config or ControllerConfig()
        self.limits = limits = ServiceLimits(config)
        self.block_size = limits.block_size
        self.pool = WorkerPool(config, limits.buckets)
        self.monitor = ServiceMonitor()
        self.dispatcher = Dispatcher(config, limits, self.pool, self.monitor)
        self.outputs = OutputProcessor(limits.model.tokenizer)  # text and stop strings
        self._requests: dict[str, RequestState] = {}
        self._tasks: set[asyncio.Task] = set()
        self._reviving: set[str] = set()
        self._state = "new"

    @property
    def buckets(self) -> BucketManager[RequestState]:
        return self.dispatcher.buckets

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self.limits.model

    async def start(self) -> None:
        """Start Ray (or the local workers), create and warm up every worker."""
        if self._state != "new":
            raise RuntimeError(f"start() runs once; the controller is {self._state}")
        self._state = "starting"
        try:
            await self.pool.start()
        except BaseException:
            self._state = "stopped"
            await self.pool.shutdown()
            raise
        self._bound_by_pools()
        self._state = "running"
        self.spawn(self._dispatch_loop())
        self.spawn(self._monitor_loop())
        for handle in self.pool.role("decode"):
            self.spawn(self._pump(handle))

    async def shutdown(self) -> None:
        """End every live request (final delta with an error), stop the workers."""
        if self._state in ("stopping", "stopped"):
            return
        self._state = "stopping"
        for state in list(self._requests.values()):
            self.finish(state, "error", "the service is shutting down")
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
        does not serve, QueueFullError at the queue bound, SloShedError when its tenant
        sheds (`shed: predicted`) and the queue ahead would make it miss its TTFT target,
        NoWorkersError without live workers."""
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
        queued = self.dispatcher.bucket_request(state)
        self._shed_if_late(state, queued)
        self.dispatcher.queue(state, queued)
        params = request.sampling_params
        for i in range(state.n):
            sample = params if state.n == 1 else params.sample(i)
            self.outputs.add(state.key(i), request.prompt_token_ids, sample)
        self._requests[request.request_id] = state
        self.monitor.submitted()
        return state.stream

    def _shed_if_late(self, state: RequestState, queued: BucketRequest[RequestState]) -> None:
        """Refuse `state` now if its tenant sheds and its forecast TTFT, corrected by how far
        forecasts fell from first tokens so far, misses its target, or no decode worker's
        running requests could absorb its prompt within their TPOT targets."""
        tenant = self.buckets.tenants.get(state.request.tenant)
        if tenant is None or not tenant.config.sheds:
            return
        target = state.request.slo_ttft_s or tenant.config.ttft_slo_s
        raw = None if target is None else self.dispatcher.forecast_ttft(queued)
        if raw is None:
            return
        forecast = self.dispatcher.ttft_bias.correct(raw)
        if forecast > target:
            wait = max(1.0, forecast - target)
            why = (
                f"with the prompts queued ahead its first token would come in about "
                f"{forecast:.2f} s, past its TTFT target of {target:g} s"
            )
        elif not self.dispatcher.tpot_room(queued):
            wait = 1.0
            why = (
                "computing its prompt and those queued ahead would make the running requests "
                "of every decode worker miss their TPOT targets"
            )
        else:
            state.forecast_ttft_s = raw
            return
        self.monitor.shed[tenant.name] += 1
        raise SloShedError(
            f"tenant {tenant.name!r}: {why}; retry after {wait:.0f} s", retry_after_s=wait
        )

    async def abort(self, request_id: str) -> bool:
        """Cancel a request: its final delta says `cancelled` and its KV blocks are freed
        (a reservation whose prefill is under way: as soon as that prefill returns)."""
        state = self._requests.get(request_id)
        if state is None or state.done:
            return False
        phase, worker = state.phase, state.decode_worker
        self.finish(state, "cancelled")
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
        """Wait until every request has finished, every restart under way has ended and every
        worker reports its blocks free and its leases closed (or `timeout_s` passes); the
        fresh stats."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._requests and loop.time() < deadline:
            await asyncio.sleep(0.02)
        while loop.time() < deadline:
            await self.refresh_stats()
            stats = self.stats()
            if stats.kv_blocks_leaked == 0 and stats.leases_open == 0 and not self._reviving:
                break
            await asyncio.sleep(0.05)
        return self.stats()

    def serving(self) -> bool:
        """Running, with a live worker for every phase (health checks say so)."""
        return self._state == "running" and self.pool.serving()

    async def refresh_stats(self) -> None:
        self.judge(await self.pool.refresh())

    async def reset_prefix_cache(self) -> int:
        """Every live worker forgets its cached prefix blocks (vLLM's `/reset_prefix_cache`);
        blocks in use stay with their requests. How many blocks were forgotten; a worker
        that fails the call is judged as any failed call (a restart starts it empty)."""
        handles = [h for h in self.pool.handles if h.alive]
        epochs = [h.epoch for h in handles]
        results = await asyncio.gather(
            *(h.call("reset_prefix_cache") for h in handles), return_exceptions=True
        )
        self.dispatcher.reset_prefix_cache()  # placement no longer expects any prefix cached
        forgotten = 0
        for handle, epoch, result in zip(handles, epochs, results, strict=True):
            if isinstance(result, Exception):
                self.on_failure(handle, result, epoch)
            else:
                forgotten += result
        return forgotten

    async def kill_worker(self, name: str) -> None:
        """Fault drill: kill a worker as a crash would (Ray restarts it, local rebuilds it)."""
        await self.pool.by_name(name).kill()

    def pick_decode(self) -> WorkerHandle | None:
        """The decode worker the next batch would reserve blocks on (the PDScheduler's)."""
        return self.dispatcher.pick_decode()

    # -- dispatch ----------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        """Each batch the dispatcher sends flies in a task of its own."""
        while True:
            await self.dispatcher.woken()
            for flight in self.dispatcher.dispatch():
                self.spawn(self._fly(flight))

    async def _fly(self, flight: Flight) -> None:
        """Apply a batch's outcomes as they come: each before the flight goes on."""
        async with aclosing(flight):
            async for outcome in flight:
                await self._apply(outcome)

    async def _apply(self, outcome: Outcome) -> None:
        match outcome:
            case Deliver(state, delta):
                self.deliver(state, delta)
            case Requeue(state, why):
                self._requeue(state, why)
            case FailRequest(state, error):
                self.finish(state, "error", error)
            case AbortOnWorker(decode, request_id, index):
                await self.abort_on(decode, request_id, index)
            case Failure(handle, error, epoch):
                self.on_failure(handle, error, epoch)

    def _requeue(self, state: RequestState, why: str) -> None:
        """Queue a request again for a re-prefill of everything it has so far, unless it may
        not be: n > 1 samples with tokens streamed, or past `max_requeues`."""
        if state.done:
            return
        if state.n > 1 and any(state.samples):
            self.finish(state, "error", f"{why}; a request of n > 1 samples is not re-prefilled")
            return
        state.requeues += 1
        self.monitor.requeued()
        if state.requeues > self.config.max_requeues:
            self.finish(state, "error", f"gave up after {state.requeues - 1} re-prefills: {why}")
            return
        logger.warning("re-queuing %s: %s", state.request_id, why)
        self.dispatcher.queue(state)

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
                self.on_failure(decode, exc, epoch)
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
                self.deliver(state, delta)
        self.dispatcher.wake()

    def deliver(self, state: RequestState, delta: TokenDelta) -> None:
        """A worker's tokens through the output processor onto the request's stream."""
        phase, waiting = state.phase, state.first_token_at is None
        out = state.accept(delta, self.outputs)
        if out is None:
            return
        if waiting and state.first_token_at is not None:
            self.dispatcher.first_token(state)
        if out.token_ids:
            self.buckets.charge_output(state.request.tenant, len(out.token_ids))
        state.stream.put(out)
        if out.finish_reason is None:
            return
        if out.finished:
            self._closed(state, out.finish_reason)
        if phase == "decode" and not delta.finished:  # a stop string: the worker runs it still
            decode = self.pool.by_name(state.decode_worker)
            index = None if out.finished else out.index
            self.spawn(self.abort_on(decode, state.request_id, index))

    def finish(self, state: RequestState, reason: str, error: str | None = None) -> None:
        """End a request now: its final delta says `reason`."""
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

    def judge(self, failures: list[Failure]) -> None:
        for failure in failures:
            self.on_failure(failure.handle, failure.error, failure.epoch)

    def on_failure(self, handle: WorkerHandle, exc: BaseException, epoch: int) -> None:
        """A call to `handle` (in its life `epoch`) failed: a death restarts the worker and
        re-queues its decoding requests for a re-prefill; anything else is logged."""
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
        self._reviving.add(handle.name)
        self.spawn(self._revive(handle, kill_first=hung_or_failed))

    async def _revive(self, handle: WorkerHandle, kill_first: bool) -> None:
        try:
            if kill_first:
                await handle.kill()
            await self.pool.revive(handle)
        except Exception:
            logger.exception("%s could not be restarted", handle.name)
            if not self.pool.role(handle.role, alive=True):
                for state in list(self._requests.values()):
                    self.finish(state, "error", f"no live {handle.role} worker is left")
        finally:
            self._reviving.discard(handle.name)
        self.dispatcher.wake()

    async def abort_on(
        self, decode: WorkerHandle, request_id: str, index: int | None = None
    ) -> None:
        """Abort the request (or only its sample `index`) on `decode`."""
        try:
            await decode.call("abort", request_id, index)
        except Exception as exc:
            self.on_failure(decode, exc, decode.epoch)

    # -- helpers -----------------------------------------------------------------------------

    async def _monitor_loop(self) -> None:
        """The global monitor: fresh worker reports, and deaths of idle workers noticed."""
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            await self.refresh_stats()
            self.dispatcher.wake()

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
            buckets = self.buckets
            self.dispatcher.buckets = BucketManager(buckets.config, buckets.shapes, padded=False)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("controller task failed", exc_info=task.exception())

