"""Device-collective transport: point-to-point send/recv over a torch.distributed group.

NCCL on CUDA, HCCL on Gaudi, gloo on CPU, so the same code runs in CPU CI.
The prefill side posts one async send per layer as soon as the layer is
written; the decode side receives them into its leased blocks on admission.
"""

from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kv_transfer.kv_format import KVBlockHandle, KVFormat
from kv_transfer.transport import KVSender, KVTransport, LayerSink, TransferError

BACKENDS = {"cuda": "nccl", "hpu": "hccl", "cpu": "gloo"}
_MAX_LAYERS = 1024  # tags: a batch's layers are tag_base + layer


def backend_for(device_type: str) -> str:
    if device_type not in BACKENDS:
        raise ValueError(f"no collective backend for device {device_type!r}; known: {BACKENDS}")
    return BACKENDS[device_type]


def create_group(
    backend: str, host: str, port: int, rank: int, world_size: int, prefix: str, timeout_s: float
) -> Any:
    """This rank's process group, rendezvousing on the controller's TCPStore at host:port.

    Built from its own store prefix, so a group can be formed again (after a
    worker restarts) without touching torch.distributed's global state.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    store = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    return dist.group.WORLD  # HCCL registers itself only as a default-group backend


@dataclass(frozen=True)
class CollectivePayload:
    src_rank: int
    tag_base: int
    dtype: str


class CollectiveTransport(KVTransport):
    name = "collective"

    def __init__(self, group: Any, rank: int, device: torch.device | str = "cpu") -> None:
        self.group = group
        self.rank = rank
        self.device = torch.device(device)
        self._batches = itertools.count()

    def sender(self, handle: KVBlockHandle, src_format: KVFormat) -> KVSender:
        if handle.rank is None:
            raise TransferError(f"decode worker {handle.decode_worker!r} has no collective rank")
        tag_base = (next(self._batches) % (1 << 20)) * _MAX_LAYERS
        return _CollectiveSender(handle, src_format, self, tag_base)

    def receive(self, handle: KVBlockHandle, payload: CollectivePayload, sink: LayerSink) -> None:
        fmt = handle.format
        dtype = getattr(torch, payload.dtype)
        for layer in range(fmt.num_layers):
            buf = torch.empty(fmt.chunk_shape(handle.num_blocks), dtype=dtype, device=self.device)
            self.group.recv([buf], payload.src_rank, payload.tag_base + layer).wait()
            sink(layer, buf)


class _CollectiveSender(KVSender):
    def __init__(
        self, handle: KVBlockHandle, src_format: KVFormat, transport: CollectiveTransport,
        tag_base: int,
    ) -> None:
        super().__init__(handle, src_format)
        self.transport = transport
        self.tag_base = tag_base
        self.pending: list[tuple[Any, torch.Tensor]] = []  # works and the tensors they read

    def _send(self, layer: int, chunk: torch.Tensor) -> None:
        chunk = chunk.contiguous()
        work = self.transport.group.send([chunk], self.handle.rank, self.tag_base + layer)
        self.pending.append((work, chunk))

    def finish(self) -> CollectivePayload:
        return CollectivePayload(self.transport.rank, self.tag_base, self.format.dtype)

    def close(self) -> None:
        """The receiver acknowledged, so every send has completed; drop the buffers."""
        self.pending = []


def collective_transport(
    device: torch.device, host: str, port: int, rank: int, world_size: int, prefix: str,
    timeout_s: float,
) -> CollectiveTransport:
    """Join the group (the backend follows the device) and wrap it as this worker's transport."""
    backend = backend_for(device.type)
    group = create_group(backend, host, port, rank, world_size, prefix, timeout_s)
    return CollectiveTransport(group, rank, device)
