"""The P->D handoff of tensor-parallel workers: prefill rank r ships the KV heads of its pool
to decode rank r through a transport of its own, under the block ids the heads agreed on,
so no shard passes through rank 0. The head drives its ranks with calls they run in order
with its steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bucketserve.kv_transfer.collective import CollectiveTransport, PairSpec
from bucketserve.kv_transfer.kv_format import KVBlockHandle, KVFormat
from bucketserve.kv_transfer.transport import KVSender, KVTransport, RankPayloads, TransferError
from bucketserve.runtime.layers.parallel_linear import kv_heads

if TYPE_CHECKING:
    from bucketserve.runtime.worker.kv_cache import KVCache
    from bucketserve.runtime.worker.model_runner import LayerHook, ModelRunner


def kv_format_of(runner: Any) -> KVFormat:
    """The format of `runner`'s pool: with a tensor-parallel group, the shard of KV heads its
    rank holds (`parallel_linear.kv_heads`)."""
    tp = getattr(runner, "tp", None)
    offset = 0
    if tp is not None and tp.size > 1:
        offset = kv_heads(runner.model_config.num_key_value_heads, tp)[0]
    return KVFormat.of(runner.kv_cache, offset)


def check_ranks(num_ranks: int, handle: KVBlockHandle) -> None:
    """ValueError unless the decode side of `handle` has `num_ranks` ranks too."""
    if handle.num_ranks != num_ranks:
        raise ValueError(
            f"this prefill worker has {num_ranks} tensor-parallel rank(s) and decode worker "
            f"{handle.decode_worker} {handle.num_ranks}: each rank's KV shard goes to the "
            "decode rank of the same index, so controller.prefill.tensor_parallel_size and "
            "controller.decode.tensor_parallel_size must be equal"
        )


@dataclass
class _Batch:
    """One batch a rank ships: its sender (None if it could not be built) and source
    blocks. An error while shipping is kept, not raised: raised inside the forward, it
    would leave this rank out of step with the group's collectives."""

    sender: KVSender | None
    blocks: list[int]
    num_layers: int
    error: BaseException | None = None
    layers: int = 0

    def hook(self, kv_cache: KVCache) -> LayerHook:
        def on_layer(layer: int) -> None:
            if self.error is not None or self.sender is None:
                return
            try:
                self.sender.send_layer(layer, kv_cache.export_blocks(layer, self.blocks))
                self.layers += 1
            except Exception as exc:
                self.error = exc

        return on_layer

    def failure(self) -> str | None:
        if self.error is not None:
            return repr(self.error)
        if self.layers != self.num_layers:
            return f"{self.layers} of {self.num_layers} layers were shipped"
        return None


class RankKV:
    """A rank's end of the handoff (a RankActor's): its pool's format, its transport (Ray's
    object store until `connect` forms its collective groups, one per peer worker's rank of
    the same index) and the batches it ships that the decode side has not acknowledged."""

    def __init__(self, worker: str, rank: int, runner: ModelRunner) -> None:
        from bucketserve.kv_transfer.ray_store import RayObjectStoreTransport

        self.worker, self.rank, self.runner = worker, rank, runner
        self.format = kv_format_of(runner)
        self.transport: KVTransport = RayObjectStoreTransport()
        self._next: _Batch | None = None  # what the next step ships
        self._batches: dict[int, _Batch] = {}

    def connect(
        self, backend: str, host: str, port: int, pairs: list[PairSpec], timeout_s: float
    ) -> None:
        if not isinstance(self.transport, CollectiveTransport):
            device = self.runner.device.torch_device
            self.transport = CollectiveTransport(self.worker, device, stash_ttl_s=timeout_s)
        self.transport.connect(backend, host, port, pairs, timeout_s)

    # -- prefill side ------------------------------------------------------------------------

    def begin_send(self, key: int, handle: KVBlockHandle, blocks: list[int]) -> None:
        """The next step's K/V of `blocks` goes to `handle` (this rank's), layer by layer."""
        try:
            sender: KVSender | None = self.transport.sender(handle, self.format)
            error = None
        except Exception as exc:
            sender, error = None, exc
        batch = _Batch(sender, blocks, self.format.num_layers, error)
        self._batches[key] = batch
        self._next = batch if sender is not None else None

    def step_hook(self) -> LayerHook | None:
        """The on_layer hook of the step about to run, if a batch was begun for it."""
        batch, self._next = self._next, None
        return None if batch is None else batch.hook(self.runner.kv_cache)

    def finish(self, key: int) -> Any:
        """This rank's payload of batch `key`; TransferError if its KV did not all leave."""
        batch = self._batches.get(key)
        failure = "never begun" if batch is None else batch.failure()
        if failure is not None:
            self.abort(key)
            raise TransferError(f"{self.worker} rank {self.rank}: KV not shipped: {failure}")
        return batch.sender.finish()

    def abort(self, key: int) -> None:
        """Batch `key` ends unshipped (its stream, if ordered, is completed)."""
        batch = self._batches.pop(key, None)
        if batch is None:
            return
        if self._next is batch:
            self._next = None
        if batch.sender is not None:
            batch.sender.abort()

    def close(self, key: int) -> None:
        """The decode side has batch `key` (or its lease ended): drop what was kept for it."""
        batch = self._batches.pop(key, None)
        if batch is not None and batch.sender is not None:
            batch.sender.close()

    # -- decode side -------------------------------------------------------------------------

    def receive(self, handle: KVBlockHandle, payload: Any, blocks: list[int]) -> None:
        """This rank's shard of a lease's KV, into `blocks` of its pool."""
        kv_cache = self.runner.kv_cache
        self.transport.receive(
            handle, payload, lambda layer, chunk: kv_cache.import_blocks(layer, blocks, chunk)
        )


class ShardedSender(KVSender):
    """A tensor-parallel prefill head's sender: its own shard goes through its transport as
    any sender's; each other rank was told (before the step) to ship its own as its forward
    writes it, and hands its payload back at `finish`, which returns them all as
    `RankPayloads`. The head's own errors are kept until `finish` as the ranks' are."""

    def __init__(
        self,
        transport: KVTransport,
        src_format: KVFormat,
        handle: KVBlockHandle,
        runner: Any,  # a RayTensorParallelRunner
        blocks: list[int],
    ) -> None:
        formats = runner.kv_formats
        check_ranks(len(formats), handle)
        for rank, fmt in enumerate(formats):
            fmt.check_compatible(handle.for_rank(rank).format)
        self.head = transport.sender(handle.for_rank(0), src_format)
        super().__init__(self.head.handle, src_format)
        self.full_handle = handle
        self.runner = runner
        self.num_ranks = len(formats)
        self.error: BaseException | None = None
        self.key = runner.begin_send(handle, blocks)

    def send_layer(self, layer: int, chunk: Any) -> None:
        self._send(layer, chunk)
        self.bytes_sent += self.format.chunk_bytes(self.handle.num_transfer_blocks) * (
            self.num_ranks
        )

    def _send(self, layer: int, chunk: Any) -> None:
        if self.error is not None:
            return
        try:
            self.head.send_layer(layer, chunk)
        except Exception as exc:
            self.error = exc

    def finish(self) -> RankPayloads:
        try:
            rest = self.runner.finish_sends(self.key)
        except BaseException:
            self.head.abort()
            raise
        try:
            if self.error is not None:
                raise TransferError(
                    f"KV of lease {self.handle.lease_id} to {self.handle.decode_worker}: "
                    f"{self.error!r}"
                )
            own = self.head.finish()
        except BaseException:
            self.head.abort()
            self.runner.drop_sends(self.key, "close")
            raise
        return RankPayloads((own, *rest))

    def abort(self) -> None:
        self.head.abort()
        self.runner.drop_sends(self.key, "abort")

    def close(self) -> None:
        self.head.close()
        self.runner.drop_sends(self.key, "close")
