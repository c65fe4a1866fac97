"""The collective KV transport's ordered streams over real gloo groups that behave as NCCL
does where it matters (tags ignored; the communicator formed at the pair's first send and
recv, each blocking until the other side's arrives): two batches in flight, an expired lease,
a failed prefill, a restarted peer, and a backend registered as a plugin (the way Habana
registers HCCL)."""

from __future__ import annotations

import datetime
import sys
import threading
import time
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist

from bucketserve.kv_transfer import collective, collective_group
from bucketserve.kv_transfer.collective import CollectiveTransport, PairSpec
from bucketserve.kv_transfer.collective_group import RECEIVER_RANK, SENDER_RANK
from bucketserve.kv_transfer.kv_format import KVBlockHandle, KVFormat
from bucketserve.kv_transfer.transport import TransferError

FMT = KVFormat(dtype="float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


class NcclLikeGroup:
    """Hands every send and recv to gloo with tag 0, so only posting order can match them;
    the first op on each side waits (5 s at most) for the other side's first op, as NCCL's
    lazily formed communicator does."""

    def __init__(self, group: Any, formed: threading.Barrier) -> None:
        self.group = group
        self.formed: threading.Barrier | None = formed
        self.tags: set[int] = set()

    def _first_op(self) -> None:
        if self.formed is not None:
            self.formed.wait()  # BrokenBarrierError when the peer never arrives
            self.formed = None

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self._first_op()
        self.tags.add(tag)
        return self.group.send(tensors, dst, 0)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        self._first_op()
        self.tags.add(tag)
        return self.group.recv(tensors, src, 0)


@pytest.fixture
def store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.fixture(autouse=True)
def nccl_like(monkeypatch: pytest.MonkeyPatch) -> None:
    real = collective_group.pair_group
    barriers: dict[str, threading.Barrier] = {}
    lock = threading.Lock()

    def pair_group(backend: str, host: str, port: int, prefix: str, *rest: Any) -> Any:
        with lock:
            formed = barriers.setdefault(prefix, threading.Barrier(2, timeout=5.0))
        return NcclLikeGroup(real(backend, host, port, prefix, *rest), formed)

    monkeypatch.setattr(collective, "pair_group", pair_group)


def connect(store: Any, links: list[tuple[CollectiveTransport, CollectiveTransport]],
            generation: int = 0, backend: str = "gloo") -> None:
    """Form a group for each (prefill, decode) link, every side in its own thread as workers do."""
    pairs: dict[CollectiveTransport, list[PairSpec]] = {}
    for p, d in links:
        prefix = f"g{generation}/{p.worker}-{d.worker}/"
        pairs.setdefault(p, []).append(PairSpec(d.worker, prefix, SENDER_RANK))
        pairs.setdefault(d, []).append(PairSpec(p.worker, prefix, RECEIVER_RANK))
    threads = [
        threading.Thread(target=t.connect, args=(backend, "127.0.0.1", store.port, specs, 30.0))
        for t, specs in pairs.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def handle(decode: str, lease: str, blocks: tuple[int, ...]) -> KVBlockHandle:
    return KVBlockHandle(decode, lease, (lease,), (blocks,), FMT)


def chunks(num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(FMT.chunk_shape(num_blocks), generator=gen) for _ in range(FMT.num_layers)]


def send(prefill: CollectiveTransport, h: KVBlockHandle, data: list[torch.Tensor]) -> Any:
    sender = prefill.sender(h, FMT)
    for layer, chunk in enumerate(data):
        sender.send_layer(layer, chunk)
    return sender.finish()


def receive(decode: CollectiveTransport, h: KVBlockHandle, payload: Any) -> list[torch.Tensor]:
    got: dict[int, torch.Tensor] = {}
    decode.receive(h, payload, lambda layer, chunk: got.__setitem__(layer, chunk.clone()))
    return [got[layer] for layer in range(FMT.num_layers)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_two_batches_in_flight_claimed_in_reverse_order(store: Any) -> None:
    p, d = CollectiveTransport("prefill-0"), CollectiveTransport("decode-0")
    connect(store, [(p, d)])
    ha, hb = handle("decode-0", "a", (0, 1)), handle("decode-0", "b", (2, 3, 4))
    a, b = chunks(2, seed=1), chunks(3, seed=2)
    pa, pb = send(p, ha, a), send(p, hb, b)
    assert same(receive(d, hb, pb), b)  # b first: a is read off the wire and kept
    assert d.stashed("prefill-0") == [pa.seq]
    assert same(receive(d, ha, pa), a)
    assert d.stashed("prefill-0") == []
    assert d._in["prefill-0"].group.tags == {0}


def test_an_expired_lease_is_dropped_and_later_batches_still_land(store: Any) -> None:
    p, d = CollectiveTransport("prefill-0"), CollectiveTransport("decode-0", stash_ttl_s=0.2)
    connect(store, [(p, d)])
    ha, hb, hc = (handle("decode-0", n, (i,)) for i, n in enumerate("abc"))
    pa, pb, pc = (send(p, h, chunks(1, seed=i)) for i, h in enumerate((ha, hb, hc)))
    assert same(receive(d, hb, pb), chunks(1, seed=1))  # a's lease expires unclaimed
    time.sleep(0.3)
    assert same(receive(d, hc, pc), chunks(1, seed=2))
    assert d.stashed("prefill-0") == []
    with pytest.raises(TransferError, match="dropped unclaimed"):
        receive(d, ha, pa)


def test_a_prefill_that_fails_mid_batch_keeps_the_stream_in_step(store: Any) -> None:
    p, d = CollectiveTransport("prefill-0"), CollectiveTransport("decode-0")
    connect(store, [(p, d)])
    ha, hb = handle("decode-0", "a", (0, 1)), handle("decode-0", "b", (2,))
    failed = p.sender(ha, FMT)
    failed.send_layer(0, chunks(2, seed=1)[0])
    failed.abort()
    pb = send(p, hb, chunks(1, seed=2))
    assert same(receive(d, hb, pb), chunks(1, seed=2))
    with pytest.raises(TransferError, match="aborted"):
        receive(d, ha, collective.CollectivePayload("prefill-0", failed.seq, "float32"))


def test_streams_of_two_prefill_workers_are_independent(store: Any) -> None:
    p0, p1 = CollectiveTransport("prefill-0"), CollectiveTransport("prefill-1")
    d = CollectiveTransport("decode-0")
    connect(store, [(p0, d), (p1, d)])
    h0, h1 = handle("decode-0", "x", (0,)), handle("decode-0", "y", (1, 2))
    x0, x1 = send(p0, h0, chunks(1, seed=5)), send(p1, h1, chunks(2, seed=6))
    assert (x0.seq, x1.seq) == (0, 0)
    assert same(receive(d, h1, x1), chunks(2, seed=6))
    assert same(receive(d, h0, x0), chunks(1, seed=5))


def test_a_restarted_prefill_rejoins_without_touching_the_other_pair(store: Any) -> None:
    p0, p1 = CollectiveTransport("prefill-0"), CollectiveTransport("prefill-1")
    d = CollectiveTransport("decode-0")
    connect(store, [(p0, d), (p1, d)])
    survivor_group = d._in["prefill-1"].group
    h = handle("decode-0", "before", (0,))
    receive(d, h, send(p0, h, chunks(1, seed=1)))
    in_flight = send(p1, handle("decode-0", "p1", (3,)), chunks(1, seed=3))

    reborn = CollectiveTransport("prefill-0")  # a new life of prefill-0, its stream restarts
    connect(store, [(reborn, d)], generation=1)
    assert d._in["prefill-1"].group is survivor_group
    h2 = handle("decode-0", "after", (1,))
    again = send(reborn, h2, chunks(1, seed=2))
    assert again.seq == 0
    assert same(receive(d, h2, again), chunks(1, seed=2))
    assert same(receive(d, handle("decode-0", "p1", (3,)), in_flight), chunks(1, seed=3))
    assert not dist.is_initialized()  # nobody formed (or re-formed) the default group


def test_a_plugin_backend_is_imported_then_built_without_the_default_group(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path HCCL takes: importing a module registers the backend (extended API), and pairs
    are built from its creator, never through init_process_group."""
    module = types.ModuleType("kvtest_backend")

    def create(options: Any, _pg_options: Any) -> Any:
        timeout = datetime.timedelta(seconds=30)
        return dist.ProcessGroupGloo(options.store, options.group_rank, options.group_size, timeout)

    def register() -> None:
        if "KVTESTGLOO" not in dist.Backend._plugins:
            dist.Backend.register_backend("kvtestgloo", create, extended_api=True, devices=["cpu"])

    imported: list[str] = []
    monkeypatch.setitem(collective_group.BACKEND_MODULES, "kvtestgloo", "kvtest_backend")
    real_import = collective_group.importlib.import_module

    def import_module(name: str) -> Any:
        if name == "kvtest_backend":
            imported.append(name)
            register()
            return module
        return real_import(name)

    monkeypatch.setattr(collective_group.importlib, "import_module", import_module)
    p, d = CollectiveTransport("prefill-0"), CollectiveTransport("decode-0")
    connect(store, [(p, d)], backend="kvtestgloo")
    h = handle("decode-0", "a", (0,))
    assert same(receive(d, h, send(p, h, chunks(1, seed=9))), chunks(1, seed=9))
    assert imported and not dist.is_initialized()


def test_hccl_without_habana_says_what_to_install() -> None:
    if "habana_frameworks" in sys.modules:
        pytest.skip("Habana's PyTorch packages are installed here")
    assert collective_group.backend_for("hpu") == "hccl"
    with pytest.raises(RuntimeError, match=r"habana_frameworks\.torch\.distributed\.hccl"):
        collective_group.pair_group("hccl", "127.0.0.1", 1, "x/", SENDER_RANK, 1.0)
