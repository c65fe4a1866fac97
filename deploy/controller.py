"""The serving controller: bucket manager -> reserve -> prefill -> KV handoff -> decode -> stream.

    controller = Controller(ControllerConfig(mode="local"))
    await controller.start()
    async for delta in controller.submit(request):  # StreamDelta, the last one finished
        ...
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Coroutine
from numbers import Integral
from typing import Any

from bucket_manager.bucket_manager import BucketManager
from bucket_manager.prefill_batch import PrefillBatch
from decode_worker.decode_worker import WorkerFailedError
from decode_worker.reservation import Reservation, ReservationError
from deploy.controller_config import ControllerConfig, default_buckets, fit_buckets
from deploy.launcher import Launcher
from deploy.model_info import ModelInfo
from deploy.request_state import RequestState
from deploy.request_stream import RequestStream
from deploy.service_stats import ServiceStats
from deploy.worker_handle import WorkerDiedError, WorkerHandle
from deploy.worker_messages import StepOutput, TokenDelta, WorkerStats
from kv_transfer.lease import LeaseError
from kv_transfer.transport import TransferError
from prefill_worker.prefill_task import PrefillResult, PrefillTask
from prefill_worker.prefill_worker import PrefillCapacityError
from runtime.model_config import ModelConfig
from runtime.request import NoWorkersError, QueueFullError, ServeRequest
from runtime.sampling_params import SamplingParams
from runtime.tokenizer import Tokenizer
from runtime.weights import resolve_model

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
        model_dir = resolve_model(config.runner.model)
        model_config = ModelConfig.from_dir(model_dir)
        max_model_len = config.runner.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{model_config.max_position_embeddings}"
            )
        self.block_size = block_size = config.runner.block_size
        max_seqs = config.scheduler.max_num_seqs
        buckets = (
            default_buckets(max_model_len, block_size, max_seqs)
            if config.buckets is None
            else fit_buckets(config.buckets, max_model_len, block_size)
        )
        self.buckets = BucketManager(buckets)
        self.launcher = Launcher(config, buckets)
        tokenizer = Tokenizer.from_dir(model_dir)
        eos = {*model_config.eos_token_ids, tokenizer.eos_token_id} - {None}
        self._model = ModelInfo(
            name=config.runner.model or "SmolLM2-135M-Instruct",
            path=model_dir,
            max_model_len=max_model_len,
            max_prompt_len=max_model_len - 1,
            block_size=block_size,
            vocab_size=model_config.vocab_size,
            eos_token_ids=frozenset(eos),
            tokenizer=tokenizer,
        )
        self._max_seq_len = max_model_len
        self._decode_capacity = 0  # blocks one batch may need at most (Eq. 5 of an empty pool)
        self._requests: dict[str, RequestState] = {}
        self._handles: list[WorkerHandle] = []
        self._tasks: set[asyncio.Task] = set()
        self._wake: asyncio.Event | None = None
        self._state = "new"
        self._counts: Counter[str] = Counter()
        self._transfer_s = 0.0
        self._reasons: Counter[str] = Counter()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self._model

    async def start(self) -> None:
        """Start Ray (or the local workers), create and warm up every worker."""
        if self._state != "new":
            raise RuntimeError(f"start() runs once; the controller is {self._state}")
        self._state = "starting"
        self._wake = asyncio.Event()
        try:
            self._handles = await self.launcher.start()
        except BaseException:
            self._state = "stopped"
            await self.launcher.shutdown()
            raise
        self._fit_limits()
        self._fit_batching()
        self._state = "running"
        self._spawn(self._dispatch_loop())
        self._spawn(self._monitor_loop())
        for handle in self._role("decode"):
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
        await self.launcher.shutdown()
        self._state = "stopped"

    async def __aenter__(self) -> Controller:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # -- requests ----------------------------------------------------------------------------

    def submit(self, request: ServeRequest) -> RequestStream:
        """Queue `request`; its deltas come out of the returned async iterator, the last with
        `finished=True`. Raises (queuing nothing) ValueError for a malformed request,
        QueueFullError at the queue bound, NoWorkersError without live workers."""
        if self._state != "running":
            raise NoWorkersError(f"the controller is {self._state}; call start() first")
        self._validate(request)
        if len(self.buckets) >= self.config.max_queued_requests:
            raise QueueFullError(
                f"{len(self.buckets)} requests are queued, the bound is "
                f"{self.config.max_queued_requests}; retry later",
                retry_after_s=1.0,
            )
        if not self._role("prefill", alive=True) or not self._role("decode", alive=True):
            raise NoWorkersError("no live prefill or decode worker; retry once they restart")
        state = RequestState(request, RequestStream(request.request_id, self.abort))
        self.buckets.add(state.bucket_request(self._max_tokens_hint(state)))
        self._requests[request.request_id] = state
        self._counts["requests_total"] += 1
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
            handle = self._by_name(worker)
            try:
                await handle.call("abort", request_id)
            except Exception as exc:  # a dead worker freed everything anyway
                logger.info("abort of %s on %s failed: %s", request_id, worker, exc)
        return True

    def stats(self) -> ServiceStats:
        running = sum(1 for s in self._requests.values() if s.phase in ("prefill", "decode"))
        return ServiceStats(
            waiting=len(self.buckets),
            running=running,
            workers=[self._worker_stats(h) for h in self._handles],
            buckets=self.buckets.snapshot(),
            requests_total=self._counts["requests_total"],
            requests_finished=self._counts["requests_finished"],
            requests_requeued=self._counts["requests_requeued"],
            kv_bytes_moved=self._counts["kv_bytes"],
            transfers=self._counts["transfers"],
            transfer_s=self._transfer_s,
            worker_restarts=sum(h.restarts for h in self._handles),
            finish_reasons=dict(self._reasons),
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

    async def refresh_stats(self) -> None:
        await asyncio.gather(*(self._poll(h) for h in self._handles if h.alive))

    async def kill_worker(self, name: str) -> None:
        """Fault drill: kill a worker as a crash would (Ray restarts it, local rebuilds it)."""
        await self._by_name(name).kill()

    # -- dispatch ----------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._dispatch()

    def _dispatch(self) -> None:
        """Form and send batches while a prefill worker has a free slot and a decode worker
        has room for the next batch."""
        while len(self.buckets):
            prefills = [
                h
                for h in self._role("prefill", alive=True)
                if h.inflight < self.config.max_batches_per_prefill
            ]
            decodes = self._role("decode", alive=True)
            if not prefills or not decodes:
                return
            decode = max(decodes, key=_decode_room)
            batch = self.buckets.next_batch(decode.free_blocks, self.block_size, time.monotonic())
            if batch is None:
                return
            prefill = max(prefills, key=lambda h: (h.free_blocks, -h.inflight))
            batch = self._fit(batch, prefill.free_blocks)
            if batch is None:  # wait for handoffs to be acknowledged
                return
            need = [(r.request_id, self._blocks(r.prompt_len)) for r in batch.requests]
            total = sum(n for _, n in need)
            prefill.inflight += 1
            prefill.pending_blocks += total
            decode.pending_blocks += total
            states = [self._requests[r.request_id] for r in batch.requests]
            now = time.monotonic()
            for state in states:
                state.phase, state.decode_worker = "prefill", decode.name
                state.dispatched_at = state.dispatched_at or now
                state.request_bucket, state.shape_bucket = batch.bucket, batch.shape
            epochs = (prefill.epoch, decode.epoch)
            self._spawn(self._handoff(prefill, decode, batch, states, need, epochs))

    def _fit(self, batch: PrefillBatch, free_blocks: int) -> PrefillBatch | None:
        """The head of `batch` whose prompts fit the prefill pool's free blocks; the rest
        goes back to the queue where it was."""
        used, n = 0, 0
        for request in batch.requests:
            used += self._blocks(request.prompt_len)
            if used > free_blocks:
                break
            n += 1
        if n < len(batch):
            self.buckets.requeue(_subset(batch, list(range(n, len(batch)))))
        return _subset(batch, list(range(n))) if n else None

    async def _handoff(
        self,
        prefill: WorkerHandle,
        decode: WorkerHandle,
        batch: PrefillBatch,
        states: list[RequestState],
        need: list[tuple[str, int]],
        epochs: tuple[int, int],
    ) -> None:
        total = sum(n for _, n in need)
        try:
            reservation = await self._reserve(decode, batch, need, epochs[1])
            if reservation is None:
                return
            result = await self._prefill(prefill, decode, batch, states, reservation, epochs)
            if result is None:
                return
            try:
                await self._admit(decode, states, reservation, result, epochs[1])
            finally:
                await self._release(prefill, result.lease_id, epochs[0])
        finally:
            if prefill.epoch == epochs[0]:
                prefill.inflight -= 1
                prefill.pending_blocks -= total
            self._wake_dispatcher()

    async def _reserve(
        self, decode: WorkerHandle, batch: PrefillBatch, need: list[tuple[str, int]], epoch: int
    ) -> Reservation | None:
        try:
            reservation = await decode.call("reserve", need, self.config.lease_ttl_s)
        except ReservationError as exc:  # its free count moved on since our last report
            logger.info("reservation on %s failed: %s", decode.name, exc)
            self._put_back(batch, count=False)
            await self._poll(decode)
            return None
        except Exception as exc:
            self._put_back(batch, count=False)
            self._on_failure(decode, exc, epoch)
            return None
        finally:
            if decode.epoch == epoch:
                decode.pending_blocks -= sum(n for _, n in need)
        if decode.epoch == epoch:
            decode.stats = reservation.stats
        return reservation

    async def _prefill(
        self,
        prefill: WorkerHandle,
        decode: WorkerHandle,
        batch: PrefillBatch,
        states: list[RequestState],
        reservation: Reservation,
        epochs: tuple[int, int],
    ) -> PrefillResult | None:
        task = PrefillTask(
            batch_id=batch.batch_id,
            requests=[s.handoff() for s in states],
            shape=batch.shape,
            graph_miss=batch.graph_miss,
            target=reservation.handle,
            max_seq_len=self._max_seq_len,
        )
        try:
            result = await prefill.call("run_batch", task)
        except Exception as exc:
            await self._release(decode, reservation.lease_id, epochs[1])
            self._put_back(batch, count=not isinstance(exc, (PrefillCapacityError, LeaseError)))
            self._on_failure(prefill, exc, epochs[0])
            return None
        if prefill.epoch == epochs[0]:
            prefill.stats = result.stats
        self._counts["kv_bytes"] += result.kv_bytes
        self._counts["transfers"] += 1
        self._transfer_s += result.send_s
        for state, first in zip(states, result.first, strict=True):
            state.prefill_s += result.compute_s
            state.transfer_s += result.send_s
            if not state.done:
                self._deliver(state, first)
        return result

    async def _admit(
        self,
        decode: WorkerHandle,
        states: list[RequestState],
        reservation: Reservation,
        result: PrefillResult,
        epoch: int,
    ) -> None:
        live = [s for s in states if s.phase == "prefill"]
        try:
            if decode.epoch != epoch:
                raise WorkerDiedError(f"{decode.name} restarted since the reservation")
            ack = await decode.call("admit", reservation.lease_id, [s.handoff() for s in live],
                                    result.payload)
        except Exception as exc:
            for state in live:
                self._requeue(state, f"admission on {decode.name} failed: {exc}")
            self._on_failure(decode, exc, epoch)
            return
        if decode.epoch != epoch:  # admitted by a life of the worker that has ended since
            for state in live:
                self._requeue(state, f"{decode.name} died after admitting it")
            return
        decode.stats = ack.stats
        self._transfer_s += ack.receive_s
        for state in live:
            state.transfer_s += ack.receive_s
            if state.request_id in ack.rejected:
                self._finish(state, "error", ack.rejected[state.request_id])
            elif state.done:  # cancelled while it was handed over
                await self._abort_on(decode, state.request_id)
            else:
                state.phase = "decode"

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
        out = state.accept(delta)
        if out is None:
            return
        state.stream.put(out)
        if out.finished:
            self._closed(state, out.finish_reason or "stop")

    def _finish(self, state: RequestState, reason: str, error: str | None = None) -> None:
        if state.phase == "queued":
            self.buckets.remove(state.request_id)
        state.stream.put(state.final(reason, error))
        self._closed(state, reason)

    def _closed(self, state: RequestState, reason: str) -> None:
        self._requests.pop(state.request_id, None)
        self._counts["requests_finished"] += 1
        self._reasons[reason] += 1

    # -- faults ------------------------------------------------------------------------------

    def _requeue(self, state: RequestState, why: str) -> None:
        """Queue a request again for a re-prefill of everything it has so far."""
        if state.done:
            return
        state.requeues += 1
        self._counts["requests_requeued"] += 1
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
            self.buckets.requeue(_subset(batch, keep))
        self._wake_dispatcher()

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
        self._spawn(self._revive(handle, isinstance(exc, WorkerFailedError)))

    async def _revive(self, handle: WorkerHandle, kill_first: bool) -> None:
        try:
            if kill_first:
                await handle.kill()
            await self.launcher.revive(handle)
        except Exception:
            logger.exception("%s could not be restarted", handle.name)
            if not self._role(handle.role, alive=True):
                for state in list(self._requests.values()):
                    self._finish(state, "error", f"no live {handle.role} worker is left")
        self._wake_dispatcher()

    # -- helpers -----------------------------------------------------------------------------

    async def _release(self, handle: WorkerHandle, lease_id: str, epoch: int) -> None:
        if handle.epoch != epoch:
            return
        try:
            await handle.call("release", lease_id)
        except Exception as exc:  # a dead worker's pool is gone with it
            self._on_failure(handle, exc, epoch)

    async def _abort_on(self, decode: WorkerHandle, request_id: str) -> None:
        try:
            await decode.call("abort", request_id)
        except Exception as exc:
            self._on_failure(decode, exc, decode.epoch)

    async def _poll(self, handle: WorkerHandle) -> None:
        epoch = handle.epoch
        try:
            stats = await handle.call("stats")
        except Exception as exc:
            self._on_failure(handle, exc, epoch)
            return
        if handle.epoch == epoch:
            handle.stats = stats

    async def _monitor_loop(self) -> None:
        """The global monitor: fresh worker reports, and deaths of idle workers noticed."""
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            await self.refresh_stats()
            self._wake_dispatcher()

    def _fit_batching(self) -> None:
        """Prefill workers that run every batch at its own shape (no padding: the CPU) take
        batches past the warmed batch sizes, up to `max_num_seqs` and `max_batched_tokens`."""
        infos = self.launcher.infos
        if not any(infos[h.name].get("padding", True) for h in self._role("prefill")):
            self.buckets = BucketManager(self.buckets.config, self.buckets.shapes, padded=False)

    def _fit_limits(self) -> None:
        """Bounds from the pools the workers actually got."""
        decode = min(h.stats.num_total_blocks for h in self._role("decode") if h.stats)
        prefill = min(h.stats.num_total_blocks for h in self._role("prefill") if h.stats)
        self._max_seq_len = min(self._model.max_model_len, decode * self.block_size)
        self._decode_capacity = self.buckets.controller.safe_blocks(decode)
        longest = min(
            self._max_seq_len - 1,
            prefill * self.block_size,
            self._decode_capacity * self.block_size - 1,
        )
        if longest < 1:
            raise ValueError(
                f"the KV pools are too small: decode {decode} and prefill {prefill} blocks of "
                f"{self.block_size} tokens cannot hold a 1-token prompt"
            )
        self._model = dataclasses.replace(self._model, max_prompt_len=longest)

    def _max_tokens_hint(self, state: RequestState) -> int:
        """The output length the bucket manager plans blocks for: what is left of max_tokens,
        capped by the length limit and by what an empty decode pool can hold."""
        left = state.request.sampling_params.max_tokens - len(state.output_token_ids)
        room = min(self._max_seq_len, self._decode_capacity * self.block_size) - state.num_tokens
        return max(1, min(left, room))

    def _validate(self, request: ServeRequest) -> None:
        if not isinstance(request, ServeRequest):
            raise ValueError(f"submit() takes a ServeRequest, got {type(request).__name__}")
        rid = request.request_id
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty str, got {rid!r}")
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        ids, vocab = request.prompt_token_ids, self._model.vocab_size
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError(f"request {rid}: prompt_token_ids must be a non-empty list of ints")
        bad = [t for t in ids if not isinstance(t, Integral) or isinstance(t, bool)
               or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {rid}: token ids {bad[:5]} are not integers in [0, {vocab})")
        if not isinstance(request.sampling_params, SamplingParams):
            raise ValueError(f"request {rid}: sampling_params must be a SamplingParams")
        request.sampling_params.validate()
        if request.tenant not in self.buckets.tenants:
            raise ValueError(
                f"request {rid}: unknown tenant {request.tenant!r}; configured tenants are "
                f"{sorted(self.buckets.tenants)}"
            )
        if isinstance(request.priority, bool) or not isinstance(request.priority, int):
            raise ValueError(f"request {rid}: priority must be an integer")
        arrival = request.arrival_time
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(
            arrival
        ):
            raise ValueError(f"request {rid}: arrival_time must be a finite time.monotonic()")
        if len(ids) > self._model.max_prompt_len:
            raise ValueError(
                f"request {rid}: the prompt has {len(ids)} tokens, at most "
                f"{self._model.max_prompt_len} fit (max_model_len {self._model.max_model_len} "
                "and the KV pools); shorten the prompt"
            )

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _role(self, role: str, alive: bool = False) -> list[WorkerHandle]:
        return [h for h in self._handles if h.role == role and (h.alive or not alive)]

    def _by_name(self, name: str | None) -> WorkerHandle:
        for handle in self._handles:
            if handle.name == name:
                return handle
        raise ValueError(f"no worker named {name!r}; workers: {[h.name for h in self._handles]}")

    def _worker_stats(self, handle: WorkerHandle) -> WorkerStats:
        stats = handle.stats or WorkerStats(handle.name, handle.role, "", 0, 0)
        return dataclasses.replace(stats, alive=handle.alive, restarts=handle.restarts)

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


def _decode_room(handle: WorkerHandle) -> tuple[int, int]:
    """Most free blocks first; among equals the lighter load."""
    load = (handle.stats.running + handle.stats.waiting) if handle.stats else 0
    return handle.free_blocks, -load


def _subset(batch: PrefillBatch, keep: list[int]) -> PrefillBatch:
    return dataclasses.replace(
        batch,
        requests=tuple(batch.requests[i] for i in keep),
        order_keys=tuple(batch.order_keys[i] for i in keep),
        kv_blocks_per_request=tuple(batch.kv_blocks_per_request[i] for i in keep),
    )
