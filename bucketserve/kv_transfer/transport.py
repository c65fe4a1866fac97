"""The KV transport interface: a prefill worker sends a batch's KV layer by layer, the decode
worker it was reserved on receives it into the leased blocks (torch-free)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from bucketserve.kv_transfer.kv_format import KVBlockHandle, KVFormat

if TYPE_CHECKING:
    import torch

TRANSPORTS = ("inprocess", "ray", "collective")
# those whose layers reach the decode side while the prompt still computes (the collective
# transport's decode side reads them at admission)
LAYERWISE = frozenset({"inprocess", "ray"})
LayerSink = Callable[[int, "torch.Tensor"], None]


class TransferError(RuntimeError):
    """A batch's KV did not arrive whole; its requests are re-queued."""


@dataclass(frozen=True)
class RankPayloads:
    """A tensor-parallel prefill's payload: `payloads[r]` is what prefill rank r's transport
    returned for its shard, which decode rank r receives."""

    payloads: tuple[Any, ...]


class KVReceiver(Protocol):
    """The decode worker's end: imports one layer of a lease's blocks."""

    def receive_kv(self, lease_id: str, layer: int, chunk: torch.Tensor) -> None: ...


class KVSender(ABC):
    """Ships one prefill batch's KV to `handle`'s decode worker: each layer's chunk holds
    the blocks the decode side does not hold yet (`handle.transfer_block_ids`).

    `send_layer` is called once per layer, in order, while the prefill's
    later layers still compute; `abort` instead of `finish` when the prefill
    fails; `finish` returns the picklable payload the
    decode worker's `KVTransport.receive` needs; `close` runs when the decode
    side acknowledged (or the lease ended) and drops what was kept for it.
    """

    def __init__(self, handle: KVBlockHandle, src_format: KVFormat) -> None:
        src_format.check_compatible(handle.format)
        self.handle = handle
        self.format = src_format
        self.bytes_sent = 0

    def send_layer(self, layer: int, chunk: torch.Tensor) -> None:
        self._send(layer, chunk)
        self.bytes_sent += self.format.chunk_bytes(self.handle.num_transfer_blocks)

    @abstractmethod
    def _send(self, layer: int, chunk: torch.Tensor) -> None: ...

    @abstractmethod
    def finish(self) -> Any: ...

    def abort(self) -> None:  # noqa: B027 - only an ordered stream must be completed
        """The prefill failed before `finish`; the batch will never be claimed."""

    def close(self) -> None:  # noqa: B027 - most transports keep nothing
        pass


class KVTransport(ABC):
    name: ClassVar[str]

    @abstractmethod
    def sender(self, handle: KVBlockHandle, src_format: KVFormat) -> KVSender: ...

    @abstractmethod
    def receive(self, handle: KVBlockHandle, payload: Any, sink: LayerSink) -> None:
        """Decode side: feed each layer's chunk of `payload` to `sink(layer, chunk)`, in order."""

    def endpoint(self) -> Any:
        """Decode side: what a sender may push layers to as they are computed (a
        `KVBlockHandle.receiver`); None where the decode side receives at admission."""
        return None

    def drop(self, lease_id: str) -> None:  # noqa: B027 - only a pushed-to transport keeps any
        """Decode side: forget what arrived for a lease that ended without admission."""


def check_transport(name: str) -> None:
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {name!r}")
