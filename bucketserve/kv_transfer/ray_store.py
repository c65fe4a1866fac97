"""Ray object store transport: each layer chunk is an object, pushed to the decode worker's
actor as soon as the layer is computed (layer-wise), or pulled by it at admission.

On one node the objects sit in shared memory and the decode side maps them without a
copy; across nodes Ray moves them between the nodes' stores, so a push crosses the network
while the prompt's later layers still compute. The decode actor keeps what arrives for a
lease (`stage`) until admission imports it into the reserved blocks, or the lease ends
(`drop`). Only small ObjectRefs travel with the prefill result.
"""

from __future__ import annotations

import threading
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
    # pulled: one ref per layer, nested so Ray does not resolve them early; pushed: none
    refs: tuple[ray.ObjectRef, ...]
    dtype: str
    pushed: int = 0  # layers pushed to the decode actor (all of them, or none)


class RayObjectStoreTransport(KVTransport):
    name = "ray"

    def __init__(self) -> None:
        self._staged: dict[str, dict[int, np.ndarray]] = {}  # decode side: lease -> layers
        self._lock = threading.Lock()

    def sender(self, handle: KVBlockHandle, src_format: KVFormat) -> KVSender:
        return _RaySender(handle, src_format)

    def endpoint(self) -> ray.actor.ActorHandle | None:
        """This actor (a decode worker), which prefills push their layers to."""
        if not ray.is_initialized():
            return None
        try:
            return ray.get_runtime_context().current_actor
        except RuntimeError:  # not inside an actor
            return None

    def stage(self, lease_id: str, layer: int, array: np.ndarray) -> None:
        """Decode side: one pushed layer of a lease, kept until admission or `drop`."""
        with self._lock:
            self._staged.setdefault(lease_id, {})[layer] = array

    def drop(self, lease_id: str) -> None:
        with self._lock:
            self._staged.pop(lease_id, None)

    def receive(self, handle: KVBlockHandle, payload: RayKVPayload, sink: LayerSink) -> None:
        layers = handle.format.num_layers
        dtype = getattr(torch, payload.dtype)
        if payload.pushed:
            with self._lock:
                staged = self._staged.pop(handle.lease_id, {})
            if sorted(staged) != list(range(layers)):
                raise TransferError(
                    f"lease {handle.lease_id}: {len(staged)} of {layers} pushed layers arrived"
                )
            arrays = [staged[layer] for layer in range(layers)]
        else:
            if len(payload.refs) != layers:
                raise TransferError(
                    f"lease {handle.lease_id}: {len(payload.refs)} of {layers} layers were sent"
                )
            arrays = ray.get(list(payload.refs))  # one round trip; the prefill has sent them all
        for layer, array in enumerate(arrays):
            sink(layer, from_wire(array, dtype))


class _RaySender(KVSender):
    """Pushes each layer to `handle.receiver` as it is computed; `finish` waits until every
    push has landed (a decode worker that died fails the batch here, not at admission).
    Without a receiver it puts each layer in the store for the decode side to pull."""

    def __init__(self, handle: KVBlockHandle, src_format: KVFormat) -> None:
        super().__init__(handle, src_format)
        self.refs: list[ray.ObjectRef] = []

    def _send(self, layer: int, chunk: torch.Tensor) -> None:
        receiver = self.handle.receiver
        if receiver is None:
            self.refs.append(ray.put(to_wire(chunk)))
        else:
            self.refs.append(receiver.stage_kv.remote(self.handle.lease_id, layer, to_wire(chunk)))

    def finish(self) -> RayKVPayload:
        if self.handle.receiver is None:
            return RayKVPayload(tuple(self.refs), self.format.dtype)
        try:
            ray.get(self.refs)
        except (ray.exceptions.RayError, TransferError) as exc:
            raise TransferError(
                f"pushing lease {self.handle.lease_id}'s KV to {self.handle.decode_worker} "
                f"failed: {exc}"
            ) from exc
        return RayKVPayload((), self.format.dtype, pushed=len(self.refs))

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
