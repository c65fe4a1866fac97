"""The prefill worker: runs whole prefill batches FCFS and ships their KV to a decode lease."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from bucketserve.kv_transfer.collective import CollectiveTransport
from bucketserve.kv_transfer.kv_format import KVBlockHandle
from bucketserve.kv_transfer.lease import Lease, LeaseError, LeaseTable
from bucketserve.kv_transfer.transport import KVSender, KVTransport
from bucketserve.kv_worker.kv_worker import KVWorker
from bucketserve.kv_worker.rank_actor import RayTensorParallelRunner
from bucketserve.kv_worker.rank_kv import ShardedSender, check_ranks
from bucketserve.kv_worker.worker_env import actor_restarted
from bucketserve.messages import PrefillResult, PrefillTask, TokenDelta, WorkerRequest, WorkerStats
from bucketserve.prefill_worker.config import PrefillWorkerConfig
from bucketserve.runtime.core.block_manager import BlockManager
from bucketserve.runtime.core.engine_request import EngineRequest
from bucketserve.runtime.core.logprobs import logprob_of
from bucketserve.runtime.core.sequence import Sequence, finish_reason
from bucketserve.runtime.worker.tensor_parallel.tp_runner import (
    RankDeadError,
    TensorParallelRunner,
)
from bucketserve.utils.moving_average import moving_average

logger = logging.getLogger(__name__)

T = TypeVar("T")
MIN_MEASURED_TOKENS = 32  # a batch's seconds per token are learned from batches this long


class PrefillCapacityError(RuntimeError):
    """The prefill pool cannot hold the batch now (handoffs not acknowledged yet); retry later."""


class PrefillWorker(KVWorker):
    """Owns a ModelRunner and its own BlockManager; one batch at a time, in arrival order.

    A batch's blocks are allocated, the padded forward runs, and as each layer's
    K/V is written the layer chunk of all its sequences goes out through the
    transport to the decode worker's leased blocks. The first tokens are
    sampled; the blocks stay held under a lease until `release` (the decode
    side acknowledged) or until the lease expires, then are freed.

    With prefix caching a sequence's leading blocks this pool has cached are taken as they
    are and only its other tokens are computed, over that cached context, within the same
    padded rectangle (a shorter query fits the bucket chosen for its prompt). Its computed
    full blocks are cached when the batch ends, and stay cached after they are freed.
    Blocks the decode worker holds already (`KVBlockHandle.num_cached_blocks`) are not
    sent.

    A tensor-parallel worker's ranks each ship their KV heads to the decode worker's rank
    of their index (`ShardedSender`); a batch that fails on the group takes the worker
    down (`group_failed`), as a decode worker's step does.

    One thread of its own builds the model, warms up and runs every batch (`_on_torch`),
    whichever of the actor's call threads asks: OpenMP keeps a thread pool per thread
    that starts parallel work, and with more pool threads in the process than cores
    libgomp stops spinning between parallel regions, and every region waits for a wake-up.
    A pipelined worker runs batches on the calling thread, so the next batch can enter
    the first stage while one flows down: its stages compute in processes of their own.
    """

    role = "prefill"

    def __init__(
        self, config: PrefillWorkerConfig | None = None, transport: KVTransport | None = None
    ) -> None:
        self.config = config = config or PrefillWorkerConfig()
        self._torch = ThreadPoolExecutor(1, thread_name_prefix=f"{config.name}-torch")
        self._on_torch(lambda: super(PrefillWorker, self).__init__(
            config.name,
            config.runner,
            config.shape_buckets,
            config.pad_to_shape_buckets,
            config.transport,
            transport,
            config.torch_threads,
            config.cpus,
            config.pipeline_parallel_size,
            config.stage_options,
            config.tensor_parallel_size,
        ))
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks,
            self.runner.block_size,
            config.runner.enable_prefix_caching,
            config.cache_shares,
        )
        self.eos_token_ids = self.runner.eos_token_ids
        self.leases = LeaseTable(f"{self.name}.{self.boot_id}", self._free_lease)
        self._held: dict[str, tuple[list[Sequence], KVSender]] = {}
        self._lock = threading.Lock()  # block manager + leases
        self._run_lock = threading.Lock()  # one batch at a time (into the stages, if any)
        self._batches = 0
        self._token_s: float | None = None
        self._exit_after_layers = self._ray_drill = None
        if config.exit_after_layers is not None:
            restarted = actor_restarted()  # a Ray actor's later life: its process is new
            self._ray_drill = restarted is not None
            self._exit_after_layers = None if restarted else config.exit_after_layers
        self._graph_misses = 0
        self._kv_bytes = 0
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name=f"{self.name}-leases", daemon=True)
        self._reaper.start()

    # -- start-up ----------------------------------------------------------------------------

    def warmup(self) -> dict:
        """Every prompt shape once (when padding; see PrefillWorkerConfig.warmup)."""
        shapes = self.shapes.prompt

        def warm() -> dict:
            result = self._warmup("prompt", self.config.warmup, shapes, self.prompt_shape)
            probe = self.probe_steps()
            if probe is not None and self._token_s is None:  # priced before the first batch
                self._token_s = probe.prompt_s / probe.prompt_tokens
            return result

        return self._on_torch(warm)

    # -- serving -----------------------------------------------------------------------------

    def run_batch(self, task: PrefillTask) -> PrefillResult:
        """Prefill `task`'s sequences; their first tokens go back, and the KV of those that
        `task.target` names goes to it (the others end at their first token: their blocks
        are freed at once). Raises ValueError for a malformed task and PrefillCapacityError
        when the pool is full, in both cases changing nothing."""
        seqs = self._sequences(task)
        held = [True]

        def submitted() -> None:
            """The batch is in the first stage: the next one may follow it down the
            pipeline (not on the collective transport, one ordered stream per pair)."""
            if not isinstance(self.transport, CollectiveTransport):
                held[0] = False
                self._run_lock.release()

        self._run_lock.acquire()
        try:
            with self._lock:
                self._allocate(seqs)
            try:
                if self.pipelined:
                    result = self._run(task, seqs, submitted)
                else:
                    result = self._on_torch(lambda: self._run(task, seqs, submitted))
            except BaseException:
                with self._lock:
                    for seq in seqs:
                        self.block_manager.free(seq)
                raise
        finally:
            if held[0]:
                self._run_lock.release()
        return result

    def _drill(self, shipped: int) -> None:
        """The fault drill of `PrefillWorkerConfig.exit_after_layers`: on Ray the process
        exits (Ray restarts the actor, whose later lives drill no more); in one process the
        batch fails there, as a crashed worker's would."""
        if shipped != self._exit_after_layers:
            return
        self._exit_after_layers = None
        if self._ray_drill:
            logger.warning("%s: fault drill, exiting after %d layers", self.name, shipped)
            os._exit(1)
        raise RuntimeError(f"{self.name}: fault drill, the batch fails after {shipped} layers")

    def _learn_token_s(self, seconds: float, tokens: int) -> None:
        """The seconds a prompt token costs here: a moving average over batches of at least
        MIN_MEASURED_TOKENS (what the controller's TTFT forecast prices prompts with)."""
        if tokens >= MIN_MEASURED_TOKENS:
            self._token_s = moving_average(self._token_s, seconds / tokens)

    def release(self, lease_id: str) -> bool:
        """The decode side has the batch: free its blocks. False if the lease already ended."""
        with self._lock:
            try:
                lease = self.leases.close(lease_id)
            except LeaseError as exc:
                logger.info("%s: release of %s: %s", self.name, lease_id, exc)
                return False
            self._free_lease(lease)
        return True

    def stats(self) -> WorkerStats:
        with self._lock:
            bm = self.block_manager
            held = sum(len(seqs) for seqs, _ in self._held.values())
            return WorkerStats(
                name=self.name,
                role=self.role,
                node_id=self.node_id,
                num_free_blocks=bm.num_free_blocks,
                num_total_blocks=bm.num_total_blocks,
                running=held,
                graph_misses=self.graph_misses(self._graph_misses),
                boot_id=self.boot_id,
                transport=self.transport_name,
                leases_open=len(self.leases),
                leases_expired=self.leases.counts.expired,
                batches=self._batches,
                kv_bytes_sent=self._kv_bytes,
                prefix_cache_queries=bm.prefix_cache_queries,
                prefix_cache_hits=bm.prefix_cache_hits,
                tenant_cache=bm.tenant_stats(),
                prefill_token_s=self._token_s,
                **self.pipeline_stats(),
                **self.graph_fields(),
            )

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (those held for a handoff stay held); how many."""
        with self._lock:
            return self.block_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self._stop.set()
        self._torch.shutdown(wait=False)
        with self._lock:
            self.leases.release_all()
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.shutdown()

    # -- internals ---------------------------------------------------------------------------

    def _on_torch(self, fn: Callable[[], T]) -> T:
        """`fn()` on the worker's torch thread; its result or its exception."""
        return self._torch.submit(fn).result()

    def _sequences(self, task: PrefillTask) -> list[Sequence]:
        if not isinstance(task, PrefillTask) or not task.requests:
            raise ValueError("run_batch takes a PrefillTask with at least one request")
        target = _target_blocks(task)
        seqs = []
        for request in task.requests:
            seq = _sequence(request)
            seqs.append(seq)
            blocks = target.get(request.request_id)
            need = self.block_manager.blocks_needed(len(seq))
            if blocks is not None and len(blocks) != need:
                raise ValueError(
                    f"request {request.request_id}: {len(seq)} tokens need {need} decode blocks, "
                    f"the lease holds {len(blocks)}"
                )
        return seqs

    def _allocate(self, seqs: list[Sequence]) -> None:
        bm = self.block_manager
        need = sum(bm.num_blocks_to_allocate(s) for s in seqs)
        if need <= bm.num_free_blocks:
            try:
                for seq in seqs:
                    bm.allocate(seq)
                return
            except ValueError:  # an earlier sequence evicted the cached prefix of a later one
                for seq in seqs:
                    if seq.block_table:
                        bm.free(seq)
        raise PrefillCapacityError(
            f"{self.name}: batch needs {need} KV blocks, {bm.num_free_blocks} of "
            f"{bm.num_total_blocks} are free ({len(self.leases)} handoffs unacknowledged)"
        )

    def _run(
        self, task: PrefillTask, seqs: list[Sequence], submitted: Callable[[], None]
    ) -> PrefillResult:
        if self.transport is None:
            raise RuntimeError(f"{self.name}: no KV transport set ({self.config.transport!r})")
        shipped = set(task.target.request_ids) if task.target else set()  # checked: _sequences
        kept, ended = [], []
        for seq, request in zip(seqs, task.requests, strict=True):
            (kept if request.request_id in shipped else ended).append(seq)
        ships = bool(kept)
        pad_to = self._pad_to(task, seqs)
        # the blocks the decode side lacks (kept is in the handle's order: _target_blocks)
        cached = task.target.num_cached_blocks if ships else ()
        src_blocks = [b for seq, n in zip(kept, cached, strict=True) for b in seq.block_table[n:]]
        sender = self._sender(task.target, src_blocks) if ships else None
        send_s = [0.0]

        def ship(layer: int) -> None:
            start = time.perf_counter()
            sender.send_layer(layer, self.runner.kv_cache.export_blocks(layer, src_blocks))
            send_s[0] += time.perf_counter() - start
            self._drill(layer + 1)

        if ships:
            self._drill(0)
        start = time.perf_counter()
        try:
            pipelined = {"on_submit": submitted} if self.pipelined else {}
            tokens = self.runner.execute(
                seqs, [len(s) - s.num_computed_tokens for s in seqs], pad_to=pad_to,
                on_layer=ship if ships else None, **pipelined,
            )  # fmt: skip
        except BaseException as exc:
            if ships:
                sender.abort()
            if self.tensor_parallel:
                self.group_failed(RankDeadError(f"a tensor-parallel prefill failed: {exc!r}"))
            raise
        compute_s = time.perf_counter() - start - send_s[0]
        self._learn_token_s(compute_s, sum(len(s) - s.num_computed_tokens for s in seqs))
        try:
            payload = sender.finish() if ships else None
        except RankDeadError as exc:
            self.group_failed(exc)
            raise
        with self._lock:
            for seq in seqs:
                seq.num_computed_tokens = len(seq)
                self.block_manager.cache_computed(seq)
            lease_id = None
            if ships:
                lease = self.leases.open(
                    [s.seq_id for s in kept], [s.block_table for s in kept], self.config.lease_ttl_s
                )
                lease_id = lease.lease_id
                self._held[lease_id] = (kept, sender)
                self._kv_bytes += sender.bytes_sent
            for seq in ended:
                self.block_manager.free(seq)
            self._batches += 1
            self._graph_misses += task.graph_miss or (self.padding and pad_to is None)
        first = [
            self._first_delta(seq, token, task.max_seq_len)
            for seq, token in zip(seqs, tokens, strict=True)
        ]
        return PrefillResult(
            batch_id=task.batch_id,
            worker=self.name,
            lease_id=lease_id,
            first=first,
            payload=payload,
            pad_to=pad_to,
            compute_s=compute_s,
            send_s=send_s[0],
            kv_bytes=sender.bytes_sent if ships else 0,
            stats=self.stats(),
        )

    def _sender(self, handle: KVBlockHandle, src_blocks: list[int]) -> KVSender:
        """The batch's sender; a tensor-parallel group's ships each rank's shard from it."""
        if isinstance(self.runner, RayTensorParallelRunner):
            return ShardedSender(self.transport, self.kv_format, handle, self.runner, src_blocks)
        check_ranks(1, handle)
        return self.transport.sender(handle, self.kv_format)

    def _pad_to(self, task: PrefillTask, seqs: list[Sequence]) -> tuple[int, int, int] | None:
        """The runner shape of the batch's bucket; None (unpadded, a miss) when the tokens
        to compute do not fit it: this pool's cache may hold less than the bucket assumed."""
        if not self.padding or task.graph_miss:
            return None
        shape = self.prompt_shape(task.shape)
        if shape[0] < len(seqs):
            raise ValueError(f"batch {task.batch_id} does not fit its shape bucket {task.shape}")
        query = max(len(s) - s.num_computed_tokens for s in seqs)
        tables = [self.block_manager.blocks_needed(len(s)) for s in seqs]
        blocks = sum(tables) if shape[1] == 1 else max(tables)  # a decode shape: the total
        if shape[1] < query or shape[2] < blocks:
            logger.info(
                "%s: batch %d (query %d, %d blocks) does not fit its shape bucket %s; unpadded",
                self.name, task.batch_id, query, blocks, task.shape,
            )  # fmt: skip
            return None
        return shape

    def _first_delta(self, seq: Sequence, token: int | None, max_seq_len: int) -> TokenDelta:
        """The sampled token and whether it already ends the request (judged as the decode
        side would: eos, a stop token id, length)."""
        logprob = logprob_of(token)
        token = int(token)  # type: ignore[arg-type]  # the chunk always ends its sequence
        offset = seq.num_output_tokens
        prompt_logprobs = None
        if seq.sampling_params.prompt_logprobs is not None and offset == 0:
            prompt_logprobs = [None] + [
                seq.prompt_logprobs.get(i) for i in range(1, seq.num_prompt_tokens)
            ]
        seq.append_token(token)
        reason = finish_reason(seq, token, self.eos_token_ids, max_seq_len)
        return TokenDelta(
            seq.seq_id,
            offset,
            [token],
            finished=reason is not None,
            finish_reason=None if reason is None else reason.value,
            logprobs=None if seq.sampling_params.logprobs is None else [logprob],
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )

    def _free_lease(self, lease: Lease) -> None:
        seqs, sender = self._held.pop(lease.lease_id)
        for seq in seqs:
            self.block_manager.free(seq)
        sender.close()

    def _reap(self) -> None:
        interval = min(0.25, self.config.lease_ttl_s / 4)
        while not self._stop.wait(interval):
            with self._lock:
                expired = self.leases.expire()
            for lease in expired:
                logger.warning(
                    "%s: handoff lease %s of %s expired unacknowledged; freed %d blocks",
                    self.name,
                    lease.lease_id,
                    list(lease.request_ids),
                    lease.num_blocks,
                )


def _sequence(request: WorkerRequest) -> Sequence:
    """The request's sample 0, which computes the prompt (and the tokens it streamed before
    a re-prefill) for every sample."""
    params = request.sampling_params
    sample0 = params if params.n == 1 else params.sample(0)  # only it is built here
    seq = EngineRequest.new(
        request.prompt_token_ids, sample0, request.request_id, tenant=request.tenant
    ).seq
    seq.token_ids.extend(request.output_token_ids)
    return seq


def _target_blocks(task: PrefillTask) -> dict[str, tuple[int, ...]]:
    """The decode blocks of each request whose KV `task.target` takes (none without one).
    It names a subsequence of the task's requests: the others end at their first token."""
    if task.target is None:
        return {}
    ids = iter(r.request_id for r in task.requests)
    if not all(any(i == named for i in ids) for named in task.target.request_ids):
        raise ValueError(f"batch {task.batch_id}: the KV handle names other requests")
    return dict(zip(task.target.request_ids, task.target.block_ids, strict=True))
