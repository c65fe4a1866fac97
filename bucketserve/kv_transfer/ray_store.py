"""Ray object store transport: one object per layer chunk, pulled by the decode worker.

On one node the objects sit in shared memory and the decode side maps them
without a copy; across nodes Ray moves them between the nodes' stores. Only
the small ObjectRefs travel with the prefill result.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import ray
import torch

from bucketserve.kv_transfer.kv_format import KVBlockHandle, KVFormat
from bucketserve.kv_transfer.transport import KVSender, KVTransport, LayerSink, TransferError

# numpy has no bfloat16: such chunks travel as their raw 16-bit patterns
_WIRE_VIEW = {torch.bfloat16: torch.int16}


@dataclass(frozen=True)
class RayKVPayload:
    refs: tuple[ray.ObjectRef, ...]  # one per layer, nested so Ray does not resolve them early
    dtype: str


class RayObjectStoreTransport(KVTransport):
    name = "ray"

    def sender(self, handle: KVBlockHandle, src_format: KVFormat) -> KVSender:
        return _RaySender(handle, src_format)

    def receive(self, handle: KVBlockHandle, payload: RayKVPayload, sink: LayerSink) -> None:
        if len(payload.refs) != handle.format.num_layers:
            raise TransferError(
                f"lease {handle.lease_id}: {len(payload.refs)} of "
                f"{handle.format.num_layers} layers were sent"
            )
        dtype = getattr(torch, payload.dtype)
        arrays = ray.get(list(payload.refs))  # one round trip; the prefill has sent them all
        for layer, array in enumerate(arrays):
            sink(layer, from_wire(array, dtype))


class _RaySender(KVSender):
    def __init__(self, handle: KVBlockHandle, src_format: KVFormat) -> None:
        super().__init__(handle, src_format)
        self.refs: list[ray.ObjectRef] = []

    def _send(self, layer: int, chunk: torch.Tensor) -> None:
        self.refs.append(ray.put(to_wire(chunk)))

    def finish(self) -> RayKVPayload:
        return RayKVPayload(tuple(self.refs), self.format.dtype)

    def close(self) -> None:
        self.refs = []


def to_wire(chunk: torch.Tensor) -> np.ndarray:
    chunk = chunk.detach().to("cpu").contiguous()
    return chunk.view(_WIRE_VIEW.get(chunk.dtype, chunk.dtype)).numpy()


def from_wire(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only view of the object store; import copies it
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(array)
    return tensor.view(dtype) if dtype in _WIRE_VIEW else tensor
