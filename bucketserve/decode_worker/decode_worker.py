"""The decode worker: continuous batching over its paged pool, fed with prefilled requests."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from bucketserve.bucket_manager.shape_buckets import ShapeBuckets
from bucketserve.bucket_manager.unified_buckets import unified_need
from bucketserve.decode_worker.config import DecodeWorkerConfig
from bucketserve.decode_worker.pacer import DecodePacer
from bucketserve.kv_transfer.kv_format import KVBlockHandle
from bucketserve.kv_transfer.lease import Lease, LeaseState, LeaseTable
from bucketserve.kv_transfer.transport import KVTransport, RankPayloads, TransferError
from bucketserve.kv_worker.kv_worker import KVWorker, WorkerFailedError
from bucketserve.kv_worker.rank_actor import RayTensorParallelRunner
from bucketserve.kv_worker.worker_env import pin_cpus
from bucketserve.messages import (
    AdmitResult,
    Reservation,
    ReservationError,
    StepOutput,
    WorkerRequest,
    WorkerStats,
    deltas_of,
)
from bucketserve.runtime.core.block_hash import ROOT_HASH, BlockHash
from bucketserve.runtime.core.outputs import RequestOutput
from bucketserve.runtime.core.sequence import Sequence as Seq
from bucketserve.runtime.core.slo_admission import tpot_slacks
from bucketserve.runtime.engine.llm_engine import LLMEngine
from bucketserve.runtime.worker.model_runner import Shape, UnifiedShape
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from bucketserve.runtime.worker.tensor_parallel.tp_runner import (
    RankDeadError,
    TensorParallelRunner,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


class DecodeWorker(KVWorker):
    """Reserve blocks for a prefill batch, receive its KV into them, admit its sequences
    (`admit_prefilled`); in the colocated topology, its engine prefills the requests itself
    (`admit_prompts`).

    A background thread steps the runtime's engine (schedule / submit /
    finish / update, preemption by recompute) while calls from the controller
    reserve, admit and abort; each step's token deltas, for every sequence
    that advanced, become one StepOutput message fetched by `next_outputs`.
    Pure decode microbatches look up their decode shape bucket `(batch, 1,
    blocks)`, blocks counting the whole batch's KV blocks (the flat block list its
    attention reads, as vllm-gaudi counts them), and pad to it when padding is on.

    That thread also builds the model and runs the warm-up (`_on_loop`): OpenMP keeps
    one thread pool per thread that starts parallel work, and with a second pool in the
    process (its workers counted against the cores) libgomp stops spinning between
    parallel regions, so every op of a step waited for its threads to wake.
    """

    role = "decode"

    def __init__(
        self, config: DecodeWorkerConfig | None = None, transport: KVTransport | None = None
    ) -> None:
        self.config = config = config or DecodeWorkerConfig()
        pin_cpus(config.cpus)  # before the loop thread starts: it inherits the pinning
        self._outbox: queue.Queue[StepOutput] = queue.Queue()
        self._tasks: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._steps = 0
        self._unbucketed_steps = 0
        self._failure: str | None = None
        self._admissions = 0
        self._step_started: float | None = None  # the running step's start
        self._pacer = None if config.pace is None else DecodePacer(config.pace)
        built: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(transport, built), name=f"{config.name}-loop", daemon=True
        )
        self._thread.start()
        built.result()

    def _build(self, transport: KVTransport | None) -> None:
        """The model, its pool and the engine, built on the loop thread."""
        config = self.config
        super().__init__(
            config.name,
            config.engine.runner,
            config.shape_buckets,
            config.pad_to_shape_buckets,
            config.transport,
            transport,
            config.torch_threads,
            config.cpus,
            config.pipeline_parallel_size,
            config.stage_options,
            config.tensor_parallel_size,
        )
        engine_config = config.engine.model_copy(update={"runner": ModelRunnerConfig()})
        self.engine = LLMEngine(engine_config, self.runner, pad_fn=self._pad_to, detokenize=False)
        self.block_manager = self.engine.block_manager
        if config.shape_buckets.strategy == "unified":  # sized for this engine and its pool
            limits = engine_config.scheduler
            shapes = config.shape_buckets.for_engine(
                limits.max_num_seqs, limits.max_num_batched_tokens, self.runner.num_kv_blocks
            )
            self.shapes = ShapeBuckets(shapes, log=False)
        self.leases = LeaseTable(f"{self.name}.{self.boot_id}", self._release_lease)
        self._handles: dict[str, KVBlockHandle] = {}

    def warmup(self) -> dict:
        """Every decode shape once (when padding; see DecodeWorkerConfig.warmup), and in
        graphs mode every prompt shape too when this worker prefills (colocated)."""
        # blocks are the batch's total (vllm-gaudi's meaning): at most a full sequence a row
        limit = self.block_manager.blocks_needed(self.runner.max_model_len)
        buckets = [b for b in self.shapes.decode if b[2] <= b[0] * limit]
        mode = self.config.warmup

        def warm() -> dict:
            if self._unified:  # every step's shape; causal ones where prompts are computed
                unified = [b for b in self.shapes.unified if self.config.prefills or not b[3]]
                return self._warmup("unified", mode, unified, lambda b: b)
            if self.config.prefills and self.runner.graphs is not None:
                self._warmup("prompt", mode, self.shapes.prompt, self.prompt_shape)
            return self._warmup("decode", mode, buckets, lambda b: b)

        def warm_and_probe() -> dict:
            result = warm()
            probe = self.probe_steps(self._unified) if self.config.prefills else None
            if probe is not None:  # the TTFT forecast has prices before the first prompt
                token_s = max(0.0, probe.prompt_s - probe.decode_s) / probe.prompt_tokens
                self.engine.scheduler.step_times.prime(probe.decode_s, token_s)
            return result

        return self._on_loop(warm_and_probe)

    def _on_loop(self, fn: Callable[[], T]) -> T:
        """`fn()` run on the loop thread between steps; its result or its exception."""
        if threading.current_thread() is self._thread:
            return fn()
        done: Future[T] = Future()
        self._tasks.put((fn, done))
        self._wake.set()
        while True:
            try:
                return done.result(timeout=1.0)
            except TimeoutError:
                self._check_alive()
                if not self._thread.is_alive():
                    raise WorkerFailedError(f"{self.name}: the loop has stopped") from None

    # -- handoff -----------------------------------------------------------------------------

    def reserve(
        self,
        requests: Sequence[tuple[str, int]],
        ttl_s: float | None = None,
        token_ids: Sequence[Sequence[int]] | None = None,
        roots: Sequence[BlockHash] | None = None,
    ) -> Reservation:
        """Hold `n` blocks for each `(request_id, n)` under one lease; raises ReservationError
        (reserving nothing) when they are not free. With each request's `token_ids` (prompt
        and tokens generated so far) and cache domain (`roots`: `TenantTag.cache_root`), its
        leading blocks this pool's prefix cache holds in that domain are taken as they are:
        the handle's `num_cached_blocks` tells the prefill not to send them."""
        ids, counts = _check_reservation(requests)
        if token_ids is not None and len(token_ids) != len(ids):
            raise ValueError(f"{len(ids)} requests to reserve for but {len(token_ids)} token lists")
        if roots is not None and len(roots) != len(ids):
            raise ValueError(f"{len(ids)} requests to reserve for but {len(roots)} cache roots")
        ttl = self.config.lease_ttl_s if ttl_s is None else ttl_s
        with self.engine.lock:
            self._check_alive()
            bm = self.block_manager
            # every block counted as if none were cached: then no request can fall short
            if sum(counts) > bm.num_free_blocks:
                raise ReservationError(
                    f"{self.name}: {sum(counts)} blocks wanted, {bm.num_free_blocks} of "
                    f"{bm.num_total_blocks} free"
                )
            split, cached = [], []
            for i, n in enumerate(counts):
                tokens = () if token_ids is None else token_ids[i]
                blocks, hits = bm.reserve_prefix(
                    tokens, n, ROOT_HASH if roots is None else roots[i]
                )
                split.append(blocks)
                cached.append(min(hits, n - 1))
            lease = self.leases.open(ids, split, ttl)
            handle = KVBlockHandle(
                self.name, lease.lease_id, tuple(ids), lease.block_ids, self.kv_format,
                tuple(cached), self.rank_formats,
                None if self.transport is None else self.transport.endpoint(),
            )  # fmt: skip
            self._handles[lease.lease_id] = handle
        return Reservation(handle, ttl, self.stats())

    def stage_kv(self, lease_id: str, layer: int, chunk) -> None:
        """One layer of a lease's KV, pushed by a prefill as it computed it (Ray object
        store): kept by the transport until admission imports it. LeaseError when the lease
        ended (the push is then dropped)."""
        with self.engine.lock:
            self.leases.get(lease_id, LeaseState.OPEN, LeaseState.RECEIVING)
            self.transport.stage(lease_id, layer, chunk)

    def receive_kv(self, lease_id: str, layer: int, chunk) -> None:
        """One layer of a lease's KV, pushed by a same-process prefill (in-process transport)."""
        with self.engine.lock:
            if layer == 0:
                self.leases.begin_receive(lease_id)
            else:
                self.leases.get(lease_id, LeaseState.RECEIVING)
            blocks = self._handles[lease_id].transfer_block_ids
        try:
            self.runner.kv_cache.import_blocks(layer, blocks, chunk)
        except BaseException:
            self.release(lease_id)
            raise
        if layer == self.kv_format.num_layers - 1:
            with self.engine.lock:
                self.leases.end_receive(lease_id)

    def admit_prefilled(
        self, lease_id: str, requests: list[WorkerRequest], payload=None
    ) -> AdmitResult:
        """Pull the lease's KV through the transport and start decoding `requests` (each with
        every token generated so far, the prefill's sample last). Lease requests missing
        from `requests` were cancelled: their blocks are freed. Raises LeaseError when the
        lease expired or is unknown (a restarted worker), TransferError when KV is lost.
        A tensor-parallel worker's ranks each take their shard of `payload` (`RankPayloads`)
        from the prefill worker's rank of their index."""
        self._delay_admission()
        with self.engine.lock:
            self._check_alive()
            lease = self.leases.begin_receive(lease_id)
            handle = self._handles[lease_id]
        start = time.perf_counter()
        blocks = handle.transfer_block_ids  # the cached ones hold their K/V already
        chunks: list[tuple[int, Any]] = []

        def land() -> None:
            ranks = self.runner.receive_shards(handle, shards, blocks) if shards else []
            try:
                for layer, chunk in chunks:
                    self.runner.kv_cache.import_blocks(layer, blocks, chunk)
            finally:
                if ranks:  # before the next step: the ranks' pools take it between steps too
                    self.runner.wait(ranks)

        try:
            own, shards = self._shards(handle, payload)
            # the wire (a collective's receives, a pull across nodes) on this call's thread,
            # while the engine steps; the pool write on the loop thread, between steps: one
            # thread of this process runs torch (see the class docstring)
            self.transport.receive(handle, own, lambda layer, chunk: chunks.append((layer, chunk)))
            self._on_loop(land)
        except BaseException as exc:
            self.release(lease_id)
            if isinstance(exc, RankDeadError):
                self.group_failed(exc)
            message = f"{self.name}: KV of lease {lease_id} did not arrive: {exc}"
            raise TransferError(message) from exc
        receive_s = time.perf_counter() - start
        with self.engine.lock:
            lease = self.leases.close(lease_id)
            del self._handles[lease_id]
            result = self._add(lease, requests)
        self._wake.set()
        result.receive_s = receive_s
        result.kv_bytes = (  # every rank's shard
            handle.format.chunk_bytes(handle.num_transfer_blocks) * handle.format.num_layers
            * handle.num_ranks
        )
        result.stats = self.stats()
        return result

    def _shards(self, handle: KVBlockHandle, payload: Any) -> tuple[Any, list[Any]]:
        """This rank's part of `payload` and the other ranks' (rank 1 first)."""
        if self.tensor_parallel and not isinstance(self.runner, RayTensorParallelRunner):
            raise TransferError(
                f"{self.name}: its tensor-parallel ranks are child processes (local mode), "
                "which no KV transport reaches; run the workers on Ray"
            )
        got = len(payload.payloads) if isinstance(payload, RankPayloads) else 1
        if got != handle.num_ranks:
            raise TransferError(
                f"{self.name}: {got} KV shard(s) arrived for {handle.num_ranks} "
                "tensor-parallel rank(s); prefill and decode need the same "
                "tensor_parallel_size"
            )
        if not isinstance(payload, RankPayloads):
            return payload, []
        return payload.payloads[0], list(payload.payloads[1:])

    def admit_prompts(self, requests: list[WorkerRequest]) -> AdmitResult:
        """Colocated shape: queue `requests` on this worker's engine, which prefills them
        (prompt and any tokens streamed before a re-queue) within its decode steps, in the
        order given among those of one rank (`WorkerRequest.priority`)."""
        self._check_alive()
        result = AdmitResult(admitted=[])
        now = time.monotonic()
        for request in requests:
            left = request.ttft_left_s
            params = request.sampling_params
            if params.stop:  # stop strings are the controller's output processor's
                params = dataclasses.replace(params, stop=[])
            try:
                self.engine.add_request(
                    list(request.prompt_token_ids),
                    params,
                    request.request_id,
                    output_token_ids=request.output_token_ids,
                    priority=request.priority,
                    ttft_deadline=None if left is None else now + left,
                    tpot_target=request.tpot_s,
                    tenant=request.tenant,
                )
            except ValueError as exc:
                result.rejected[request.request_id] = str(exc)
            else:
                result.admitted.append(request.request_id)
        self._wake.set()
        result.stats = self.stats()
        return result

    def release(self, lease_id: str) -> bool:
        """Give a lease's blocks back (its prefill failed). False if it already ended."""
        with self.engine.lock:
            if lease_id not in self.leases:
                return False
            self.leases.release(lease_id)
            return True

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Cancel a running request (or only its sample `index`) now and free its blocks;
        its final delta follows."""
        done = self.engine.abort(request_id, index)
        self._wake.set()
        return done

    # -- outputs -----------------------------------------------------------------------------

    def next_outputs(self, timeout_s: float = 1.0) -> list[StepOutput]:
        """Step messages not fetched yet, oldest first; waits up to `timeout_s` for one."""
        self._check_alive()
        try:
            first = self._outbox.get(timeout=timeout_s)
        except queue.Empty:
            return []
        out = [first]
        while True:
            try:
                out.append(self._outbox.get_nowait())
            except queue.Empty:
                return out

    def stats(self) -> WorkerStats:
        with self.engine.lock:
            bm, sched = self.block_manager, self.engine.scheduler
            return WorkerStats(
                name=self.name,
                role=self.role,
                node_id=self.node_id,
                num_free_blocks=bm.num_free_blocks,
                num_total_blocks=bm.num_total_blocks,
                running=len(sched.running),
                waiting=len(sched.waiting),
                preemptions=sched.num_preemptions,
                slo_holds=0 if sched.slo is None else sched.slo.num_holds,
                paced_s=0.0 if self._pacer is None else self._pacer.held_s,
                graph_misses=self.graph_misses(self.shapes.graph_misses + self._unbucketed_steps),
                boot_id=self.boot_id,
                transport=self.transport_name,
                alive=self._failure is None,
                leases_open=len(self.leases),
                leases_expired=self.leases.counts.expired,
                reserved_blocks=bm.num_reserved_blocks,
                blocks_to_come=self._blocks_to_come(),
                batches=self._steps,
                prefix_cache_queries=bm.prefix_cache_queries,
                prefix_cache_hits=bm.prefix_cache_hits,
                tenant_cache=bm.tenant_stats(),
                prefill_token_s=sched.step_times.prefill_token_s,
                decode_step_s=sched.step_times.decode_s,
                tpot_slack_s=self._tpot_slack(),
                prompt_tokens_to_come=sum(
                    s.num_uncomputed_tokens
                    for s in (*sched.waiting, *sched.running)
                    if s.num_uncomputed_tokens > 1
                ),
                **self.pipeline_stats(),
                **self.graph_fields(),
            )

    def _tpot_slack(self) -> float | None:
        """The least of the seconds the running requests' TPOT targets can still absorb
        (None: none has a target it can meet, or no step was measured)."""
        sched = self.engine.scheduler
        decode_s = sched.step_times.decode_s
        if decode_s is None:
            return None
        slacks = tpot_slacks(sched.running, time.monotonic(), decode_s)
        return min((s for s, _ in slacks), default=None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (those in use stay with their sequences); how many."""
        with self.engine.lock:
            self._check_alive()
            return self.block_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        self.engine.close()
        if isinstance(self.runner, TensorParallelRunner):  # the engine does not own it
            self.runner.shutdown()
        with self.engine.lock:
            self.leases.release_all()

    # -- the loop ----------------------------------------------------------------------------

    def _run(self, transport: KVTransport | None, built: Future[None]) -> None:
        try:
            self._build(transport)
        except BaseException as exc:
            built.set_exception(exc)
            return
        built.set_result(None)
        self._loop()

    def _run_tasks(self) -> None:
        while True:
            try:
                fn, done = self._tasks.get_nowait()
            except queue.Empty:
                return
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_tasks()
                with self.engine.lock:
                    expired = self.leases.expire()
                self._log_expired(expired)
                if not self.engine.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                if self._hold():
                    continue
                self._step_started = time.monotonic()
                outputs = self.engine.step()
                self._step_started = None
                self._check_ranks(outputs)
                if outputs:
                    self._publish(outputs)
                elif not self.engine.executor.num_in_flight:
                    self._wake.wait(0.005)  # nothing runnable yet: do not spin
        except Exception as exc:
            logger.exception("%s: decode loop failed", self.name)
            self._failure = f"{self.name}: decode loop failed: {exc!r}"

    def _check_ranks(self, outputs: list[RequestOutput]) -> None:
        """A step that failed on a tensor-parallel group fails the worker instead of its
        requests: a dead rank (or ranks out of step after an error) cannot run another,
        and the controller re-prefills the requests on the revived worker with every rank.
        In a Ray actor the process exits, as a stage group's head does, so Ray's restart
        is under way before the controller next calls it."""
        if not isinstance(self.runner, TensorParallelRunner):
            return
        failed = any(c.finish_reason == "error" for o in outputs for c in o.outputs or [o])
        if self.runner.alive() and not failed:
            return
        gone = "a rank is gone" if not self.runner.alive() else "the ranks are out of step"
        self.group_failed(RankDeadError(f"a tensor-parallel step failed: {gone}"))

    def _hold(self) -> bool:
        """Wait (up to 50 ms, or until called) while pacing lets the next step wait;
        True if it waited."""
        pacer = self._pacer
        if pacer is None:
            return False
        with self.engine.lock:
            if not len(self.leases):  # no prefill batch for this worker in flight
                return False
            sched = self.engine.scheduler
            now = time.monotonic()
            step_s = sched.step_times.decode_s or 0.0
            hold = pacer.hold_s(sched.running, len(sched.waiting), now, step_s)
        if hold <= 0:
            return False
        self._wake.wait(min(hold, 0.05))
        self._wake.clear()
        pacer.record(time.monotonic() - now)
        return True

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self._steps += 1
        deltas = [delta for out in outputs for delta in deltas_of(out)]
        self._outbox.put(StepOutput(self.name, self.boot_id, self._steps, deltas, self.stats()))

    def _blocks_to_come(self) -> int:
        """Blocks the engine will still allocate for prompts it has not fully prefilled:
        all of a waiting one's, the rest of a running one's (colocated, chunked prefill)."""
        bm, sched = self.block_manager, self.engine.scheduler
        waiting = sum(bm.blocks_needed(len(s)) - len(s.block_table) for s in sched.waiting)
        running = sum(
            bm.blocks_needed(len(s)) - len(s.block_table)
            for s in sched.running
            if s.num_computed_tokens < len(s) - 1
        )
        return waiting + running

    @property
    def _unified(self) -> bool:
        """Unified buckets: every step pads to one (a stage group pads none)."""
        return bool(self.shapes.unified) and not self.pipelined

    def _pad_to(self, seqs: list[Seq], counts: list[int]) -> Shape | UnifiedShape | None:
        """The decode bucket of a pure decode microbatch (looked up, and misses counted,
        even when not padding). Recompute chunks after a preemption have no warmed
        shape here: they run unpadded and count as misses. Unified buckets hold every
        step, prompt chunks and decode rows together."""
        if self._unified:
            tables = [s.block_table for s in seqs]
            computed = [s.num_computed_tokens for s in seqs]
            need = unified_need(tables, computed, counts, self.block_manager.block_size)
            shape, miss = self.shapes.pad_unified(need)
            return shape if self.padding and not miss else None
        if any(n != 1 for n in counts):
            self._unbucketed_steps += 1
            return None
        blocks = sum(self.block_manager.blocks_needed(s.num_computed_tokens + 1) for s in seqs)
        shape, miss = self.shapes.pad_decode(len(seqs), blocks)
        return shape if self.padding and not miss else None

    def _add(self, lease: Lease, requests: list[WorkerRequest]) -> AdmitResult:
        by_id = {r.request_id: r for r in requests}
        result = AdmitResult(admitted=[])
        for rid in set(by_id) - set(lease.request_ids):
            result.rejected[rid] = f"not in lease {lease.lease_id}"
        for rid, blocks in zip(lease.request_ids, lease.block_ids, strict=True):
            request = by_id.get(rid)
            if request is None:  # cancelled while it was prefilled
                self.block_manager.release(blocks)
                continue
            try:
                self.engine.add_prefilled_request(
                    request.prompt_token_ids,
                    request.output_token_ids[-1],
                    list(blocks),
                    request.sampling_params,
                    rid,
                    output_token_ids=request.output_token_ids[:-1],
                    priority=request.priority,
                    tpot_target=request.tpot_s,
                    tenant=request.tenant,
                )
            except (ValueError, IndexError) as exc:
                self.block_manager.release(blocks)
                result.rejected[rid] = str(exc)
            else:
                result.admitted.append(rid)
        return result

    def _delay_admission(self) -> None:
        """The fault drill of DecodeWorkerConfig.admit_delay_s."""
        with self.engine.lock:
            self._admissions += 1
            n = self._admissions
        count = self.config.admit_delay_count
        if self.config.admit_delay_s and (count == 0 or n <= count):
            time.sleep(self.config.admit_delay_s)

    def _release_lease(self, lease: Lease) -> None:
        for blocks in lease.block_ids:  # per request: requests may share cached blocks
            self.block_manager.release(blocks)
        self._handles.pop(lease.lease_id, None)
        if self.transport is not None:
            self.transport.drop(lease.lease_id)

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise WorkerFailedError(self._failure)
        started, limit = self._step_started, self.config.stall_timeout_s
        if started is not None and limit is not None and time.monotonic() - started > limit:
            raise WorkerFailedError(
                f"{self.name}: one step has run {time.monotonic() - started:.0f} s, past "
                f"stall_timeout_s {limit:g}; declared hung"
            )

    def _log_expired(self, expired: list[Lease]) -> None:
        for lease in expired:
            logger.warning(
                "%s: reservation %s of %s expired before admission; freed %d blocks",
                self.name,
                lease.lease_id,
                list(lease.request_ids),
                lease.num_blocks,
            )


def _check_reservation(requests: Sequence[tuple[str, int]]) -> tuple[list[str], list[int]]:
    pairs = list(requests)
    ok = bool(pairs) and all(
        isinstance(p, (tuple, list))
        and len(p) == 2
        and isinstance(p[0], str)
        and isinstance(p[1], int)
        and not isinstance(p[1], bool)
        and p[1] >= 1
        for p in pairs
    )
    if not ok or len({p[0] for p in pairs}) != len(pairs):
        raise ValueError(
            "reserve takes a non-empty list of (request_id, num_blocks >= 1) with distinct ids"
        )
    return [p[0] for p in pairs], [p[1] for p in pairs]

