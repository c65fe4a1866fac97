"""Same-process transport: each layer is copied straight into the decode pool's leased blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bucketserve.kv_transfer.kv_format import KVBlockHandle, KVFormat
from bucketserve.kv_transfer.transport import (
    KVReceiver,
    KVSender,
    KVTransport,
    LayerSink,
    TransferError,
)

if TYPE_CHECKING:
    import torch


class InProcessTransport(KVTransport):
    """Decode workers living in this process register here under their names."""

    name = "inprocess"

    def __init__(self) -> None:
        self._receivers: dict[str, KVReceiver] = {}

    def register(self, name: str, receiver: KVReceiver) -> None:
        self._receivers[name] = receiver

    def sender(self, handle: KVBlockHandle, src_format: KVFormat) -> KVSender:
        receiver = self._receivers.get(handle.decode_worker)
        if receiver is None:
            raise TransferError(
                f"decode worker {handle.decode_worker!r} is not registered in this process; "
                f"known: {sorted(self._receivers)}"
            )
        return _InProcessSender(handle, src_format, receiver)

    def receive(self, handle: KVBlockHandle, payload: int, sink: LayerSink) -> None:
        """Nothing left to move: the sender wrote every layer already; check it did."""
        if payload != handle.format.num_layers:
            raise TransferError(
                f"lease {handle.lease_id}: {payload} of {handle.format.num_layers} layers arrived"
            )


class _InProcessSender(KVSender):
    def __init__(self, handle: KVBlockHandle, src_format: KVFormat, receiver: KVReceiver) -> None:
        super().__init__(handle, src_format)
        self.receiver = receiver
        self.layers = 0

    def _send(self, layer: int, chunk: torch.Tensor) -> None:
        self.receiver.receive_kv(self.handle.lease_id, layer, chunk)
        self.layers += 1

    def finish(self) -> int:
        return self.layers
