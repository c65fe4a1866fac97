"""Device-collective transport: point-to-point send/recv over one group per worker pair.

NCCL ignores tags and matches a pair's sends to its receives in posting order
(HCCL too), so nothing here relies on tags: every prefill -> decode pair is one
ordered stream of batches, each `header, layer 0..L-1, trailer` (the header counts the
blocks sent: those the decode side does not hold already). The decode side
claims batches by their place in that stream; a batch it reaches before its
admission (two batches in flight, admitted out of order) is read off the wire
and stashed, and one whose lease expired is dropped from the stash after the
lease's lifetime. A prefill that fails mid-batch still completes its batch on
the wire (marked aborted in the trailer), so the stream never falls out of step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from bucketserve.kv_transfer.collective_group import RECEIVER_RANK, SENDER_RANK, pair_group
from bucketserve.kv_transfer.kv_format import KVBlockHandle, KVFormat
from bucketserve.kv_transfer.transport import KVSender, KVTransport, LayerSink, TransferError

_OK, _ABORTED = 1, 0


@dataclass(frozen=True)
class CollectivePayload:
    sender: str  # the prefill worker: names the pair group on the decode side
    seq: int  # the batch's place in that pair's stream
    dtype: str


@dataclass(frozen=True)
class PairSpec:
    """One pair this worker belongs to: the peer's name, the pair's store prefix, our rank."""

    peer: str
    prefix: str
    rank: int


@dataclass
class _Outbound:
    group: Any
    next_seq: int = 0
    open: bool = False  # a batch's layers are on the wire and its trailer is not
    # Works not yet received, with the tensors they read: a send whose work is dropped
    # early is cancelled, which would leave the stream out of step.
    inflight: deque[tuple[Any, torch.Tensor]] = field(default_factory=deque)

    def post(self, tensor: torch.Tensor) -> None:
        while self.inflight and self.inflight[0][0].is_completed():
            self.inflight.popleft()
        self.inflight.append((self.group.send([tensor], RECEIVER_RANK, 0), tensor))


@dataclass
class _Stashed:
    layers: list[torch.Tensor]
    ok: bool
    arrived: float


@dataclass
class _Inbound:
    group: Any
    next_seq: int = 0  # the next batch on the wire
    stash: dict[int, _Stashed] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class CollectiveTransport(KVTransport):
    name = "collective"

    def __init__(
        self, worker: str, device: torch.device | str = "cpu", stash_ttl_s: float = 30.0
    ) -> None:
        self.worker = worker  # this worker's name, as its peers know it
        self.device = torch.device(device)
        self.stash_ttl_s = stash_ttl_s  # a batch nobody claims this long had its lease expire
        self._out: dict[str, _Outbound] = {}
        self._in: dict[str, _Inbound] = {}

    # -- groups ------------------------------------------------------------------------------

    def connect(
        self, backend: str, host: str, port: int, pairs: list[PairSpec], timeout_s: float
    ) -> None:
        """Form (or re-form) the groups of `pairs` at once, each peer doing the same; a peer
        that is not named keeps its group and its stream."""
        with ThreadPoolExecutor(max(1, len(pairs))) as pool:
            groups = list(pool.map(
                lambda p: self._form(backend, host, port, p, timeout_s), pairs
            ))
        for pair, group in zip(pairs, groups, strict=True):
            if pair.rank == SENDER_RANK:
                self._out[pair.peer] = _Outbound(group)
            else:
                self._in[pair.peer] = _Inbound(group)

    def _form(self, backend: str, host: str, port: int, pair: PairSpec, timeout_s: float) -> Any:
        """The pair's group, its communicator formed now by one handshake message: NCCL
        forms it at the first send and recv, which would otherwise be the first batch's,
        whose recv waits for that send to finish (a deadlock)."""
        group = pair_group(backend, host, port, pair.prefix, pair.rank, timeout_s)
        token = torch.zeros(1, dtype=torch.int32, device=self.device)
        if pair.rank == SENDER_RANK:
            group.send([token], RECEIVER_RANK, 0).wait()
        else:
            group.recv([token], SENDER_RANK, 0).wait()
        return group

    def peers(self) -> list[str]:
        return sorted({*self._out, *self._in})

    # -- prefill side ------------------------------------------------------------------------

    def sender(self, handle: KVBlockHandle, src_format: KVFormat) -> KVSender:
        out = self._out.get(handle.decode_worker)
        if out is None:
            raise TransferError(f"no KV group with decode worker {handle.decode_worker!r}")
        if out.open:
            raise RuntimeError(f"a batch to {handle.decode_worker} is still on the wire")
        return _CollectiveSender(handle, src_format, self, out)

    # -- decode side -------------------------------------------------------------------------

    def receive(self, handle: KVBlockHandle, payload: CollectivePayload, sink: LayerSink) -> None:
        inbound = self._in.get(payload.sender)
        if inbound is None:
            raise TransferError(f"no KV group with prefill worker {payload.sender!r}")
        dtype = getattr(torch, payload.dtype)
        with inbound.lock:
            self._evict(inbound)
            stashed = inbound.stash.pop(payload.seq, None)
            if stashed is None and payload.seq < inbound.next_seq:
                raise TransferError(
                    f"batch {payload.seq} from {payload.sender} was dropped unclaimed after "
                    f"{self.stash_ttl_s:g} s"
                )
            while stashed is None:
                seq, layers, ok = self._read(inbound, handle.format, dtype, payload, sink)
                if seq == payload.seq:
                    stashed = _Stashed([], ok, time.monotonic())  # already fed to `sink`
                else:
                    inbound.stash[seq] = _Stashed(layers, ok, time.monotonic())
        if not stashed.ok:
            raise TransferError(f"prefill {payload.sender} aborted batch {payload.seq}")
        for layer, chunk in enumerate(stashed.layers):
            sink(layer, chunk)

    def stashed(self, sender: str) -> list[int]:
        """Batches from `sender` read off the wire but not claimed yet."""
        return sorted(self._in[sender].stash)

    def _read(
        self, inbound: _Inbound, fmt: KVFormat, dtype: torch.dtype, want: CollectivePayload,
        sink: LayerSink,
    ) -> tuple[int, list[torch.Tensor], bool]:
        """The next batch on the wire: fed to `sink` if it is `want`, else kept."""
        seq, num_blocks, num_layers = self._ints(inbound.group, 3)
        if seq != inbound.next_seq:
            raise TransferError(f"KV stream from {want.sender} out of step: got batch {seq}, "
                                f"expected {inbound.next_seq}")
        inbound.next_seq += 1
        layers = []
        for layer in range(num_layers):
            buf = torch.empty(fmt.chunk_shape(num_blocks), dtype=dtype, device=self.device)
            inbound.group.recv([buf], SENDER_RANK, 0).wait()
            if seq == want.seq:
                sink(layer, buf)
            else:
                layers.append(buf)
        trailer_seq, ok = self._ints(inbound.group, 2)
        assert trailer_seq == seq, (trailer_seq, seq)
        return seq, layers, ok == _OK

    def _ints(self, group: Any, n: int) -> list[int]:
        buf = torch.empty(n, dtype=torch.int32, device=self.device)
        group.recv([buf], SENDER_RANK, 0).wait()
        return [int(v) for v in buf.tolist()]

    def _evict(self, inbound: _Inbound) -> None:
        limit = time.monotonic() - self.stash_ttl_s
        for seq in [s for s, b in inbound.stash.items() if b.arrived < limit]:
            del inbound.stash[seq]


class _CollectiveSender(KVSender):
    def __init__(
        self, handle: KVBlockHandle, src_format: KVFormat, transport: CollectiveTransport,
        out: _Outbound,
    ) -> None:
        super().__init__(handle, src_format)
        self.transport = transport
        self.out = out
        self.seq = out.next_seq
        self.layers_sent = 0
        out.next_seq += 1
        out.open = True
        self._post_ints([self.seq, handle.num_transfer_blocks, src_format.num_layers])

    def _send(self, layer: int, chunk: torch.Tensor) -> None:
        assert layer == self.layers_sent, "layers go out in order"
        self.out.post(chunk.contiguous())
        self.layers_sent += 1

    def finish(self) -> CollectivePayload:
        self._end(_OK)
        return CollectivePayload(self.transport.worker, self.seq, self.format.dtype)

    def abort(self) -> None:
        """The prefill failed: fill the missing layers so the pair's stream stays in step."""
        if not self.out.open:
            return
        shape = self.format.chunk_shape(self.handle.num_transfer_blocks)
        while self.layers_sent < self.format.num_layers:
            self._send(self.layers_sent, torch.zeros(
                shape, dtype=getattr(torch, self.format.dtype), device=self.transport.device
            ))
        self._end(_ABORTED)

    def _end(self, status: int) -> None:
        self._post_ints([self.seq, status])
        self.out.open = False

    def _post_ints(self, values: list[int]) -> None:
        self.out.post(torch.tensor(values, dtype=torch.int32, device=self.transport.device))

