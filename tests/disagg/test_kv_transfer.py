"""The KV wire format and a prefill -> decode handoff between real workers, layer by layer."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch

from bucketserve.decode_worker.config import DecodeWorkerConfig
from bucketserve.decode_worker.decode_worker import DecodeWorker
from bucketserve.kv_transfer.inprocess import InProcessTransport
from bucketserve.kv_transfer.kv_format import KVBlockHandle, KVFormat
from bucketserve.kv_transfer.ray_store import from_wire, to_wire
from bucketserve.kv_transfer.transport import KVSender, LayerSink
from bucketserve.messages import PrefillTask, ReservationError, ServeRequest, WorkerRequest
from bucketserve.prefill_worker.config import PrefillWorkerConfig
from bucketserve.prefill_worker.prefill_worker import PrefillWorker
from bucketserve.runtime.engine.engine_config import EngineConfig
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from tests.disagg.helpers import BLOCK_SIZE

FORMAT = KVFormat("float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=16)


def test_the_wire_format_names_dtype_layout_and_block_size() -> None:
    assert FORMAT.layout == "kv,block,slot,kv_head,head_dim"
    assert FORMAT.chunk_shape(3) == (2, 3, 4, 2, 16)
    assert FORMAT.chunk_bytes(3) == 2 * 3 * 4 * 2 * 16 * 4
    bf16 = dataclasses.replace(FORMAT, dtype="bfloat16")
    bf16.check_compatible(FORMAT)  # dtype converts on import; shapes must agree
    assert bf16.chunk_bytes(3) == FORMAT.chunk_bytes(3) // 2
    with pytest.raises(ValueError, match="block_size 4 vs 16, num_kv_heads 2 vs 4"):
        FORMAT.check_compatible(dataclasses.replace(FORMAT, block_size=16, num_kv_heads=4))
    with pytest.raises(ValueError, match="KV dtype must be one of"):
        KVFormat("int8", 4, 2, 2, 16)
    with pytest.raises(ValueError, match="unknown KV chunk layout"):
        KVFormat("float32", 4, 2, 2, 16, layout="block,kv")
    with pytest.raises(ValueError, match=r"KVFormat\.block_size must be a positive integer"):
        KVFormat("float32", 0, 2, 2, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_chunk_survives_the_object_store_wire_bit_for_bit(dtype: torch.dtype) -> None:
    chunk = torch.randn(FORMAT.chunk_shape(3)).to(dtype)
    back = from_wire(to_wire(chunk), dtype)
    assert back.dtype == dtype and torch.equal(back, chunk)


def runner(model_dir: Path, dtype: str) -> ModelRunnerConfig:
    return ModelRunnerConfig(
        model=str(model_dir), dtype=dtype, block_size=BLOCK_SIZE, num_kv_blocks=64
    )


class LayerLog:
    """The decode worker's receiving end, noting for each layer chunk how many layers the
    prefill had written by then (a fresh pool is all zeros until written)."""

    def __init__(self, decode: DecodeWorker, prefill: PrefillWorker) -> None:
        self.decode, self.prefill = decode, prefill
        self.events: list[tuple[int, int]] = []

    def receive_kv(self, lease_id: str, layer: int, chunk: torch.Tensor) -> None:
        kv = self.prefill.runner.kv_cache.kv
        written = sum(bool(kv[i].abs().sum() > 0) for i in range(kv.shape[0]))
        self.events.append((layer, written))
        self.decode.receive_kv(lease_id, layer, chunk)


@pytest.mark.parametrize("prefill_dtype", ["float32", "bfloat16"])
def test_kv_moves_layer_by_layer_into_the_reserved_blocks(
    tiny_model_dir: Path, work: list, reference: list, prefill_dtype: str
) -> None:
    transport = InProcessTransport()
    prefill = PrefillWorker(
        PrefillWorkerConfig(runner=runner(tiny_model_dir, prefill_dtype), transport="inprocess"),
        transport,
    )
    decode = DecodeWorker(
        DecodeWorkerConfig(
            engine=EngineConfig(runner=runner(tiny_model_dir, "float32")), transport="inprocess"
        ),
        transport,
    )
    log = LayerLog(decode, prefill)
    transport.register(decode.name, log)
    try:
        requests = [
            WorkerRequest(ServeRequest(f"r{i}", list(p), s), [])
            for i, (p, s) in enumerate(work[:3])
        ]
        need = [(r.request_id, -(-len(r.prompt_token_ids) // BLOCK_SIZE)) for r in requests]
        with pytest.raises(ValueError, match="distinct ids"):
            decode.reserve([("r0", 1), ("r0", 1)])
        with pytest.raises(ReservationError, match="65 blocks wanted, 64 of 64 free"):
            decode.reserve([("r0", 65)])
        reservation = decode.reserve(need)
        total = sum(n for _, n in need)
        assert decode.stats().reserved_blocks == total and decode.stats().leases_open == 1
        task = PrefillTask(0, requests, (3, 64, 0), True, reservation.handle, 512)
        result = prefill.run_batch(task)

        assert log.events == [(0, 1), (1, 2)]  # layer 0 left before layer 1 was computed
        assert result.kv_bytes == 2 * FORMAT.chunk_bytes(total) // (
            4 // (2 if prefill_dtype == "bfloat16" else 4)
        )
        src = [b for s in prefill._held[result.lease_id][0] for b in s.block_table]
        dst = reservation.handle.flat_block_ids
        for layer in range(2):
            sent = prefill.runner.kv_cache.export_blocks(layer, src)
            landed = decode.runner.kv_cache.export_blocks(layer, dst)
            assert landed.dtype == torch.float32 and torch.equal(landed, sent.float())

        for request, first in zip(requests, result.first, strict=True):
            request.output_token_ids = list(first.token_ids)
        ack = decode.admit_prefilled(reservation.lease_id, requests, result.payload)
        assert ack.admitted == ["r0", "r1", "r2"] and not ack.rejected
        assert prefill.release(result.lease_id) and not prefill.release(result.lease_id)
        got = _drain(decode, requests)
        if prefill_dtype == "float32":
            assert [got[r.request_id] for r in requests] == reference[:3]
        else:  # bf16 KV: only the first token is exactly the float32 model's
            assert [got[r.request_id][0] for r in requests] == [t[0] for t in reference[:3]]
        assert prefill.stats().num_free_blocks == 64 and prefill.stats().leases_open == 0
        stats = decode.stats()
        assert stats.num_free_blocks == 64 and stats.reserved_blocks == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def _drain(decode: DecodeWorker, requests: list[WorkerRequest]) -> dict[str, list[int]]:
    out = {r.request_id: list(r.output_token_ids) for r in requests}
    done: set[str] = set()
    deadline = time.monotonic() + 30
    while len(done) < len(requests) and time.monotonic() < deadline:
        for step in decode.next_outputs(0.5):
            for delta in step.deltas:
                ids, at = out[delta.request_id], delta.token_offset
                assert ids[at:] == delta.token_ids[: len(ids) - at]  # overlaps agree
                ids += delta.token_ids[len(ids) - at :]
                if delta.finished:
                    done.add(delta.request_id)
    assert len(done) == len(requests)
    return out


class CarriedTransport(InProcessTransport):
    """The Ray object store's shape without Ray: every layer rides in the payload that
    `admit` carries, and the decode side imports it on receipt."""

    def sender(self, handle: KVBlockHandle, src_format: KVFormat) -> KVSender:
        return _CarriedSender(handle, src_format)

    def receive(self, handle: KVBlockHandle, payload: list, sink: LayerSink) -> None:
        for layer, chunk in enumerate(payload):
            sink(layer, chunk)


class _CarriedSender(KVSender):
    def __init__(self, handle: KVBlockHandle, src_format: KVFormat) -> None:
        super().__init__(handle, src_format)
        self.chunks: list[torch.Tensor] = []

    def _send(self, layer: int, chunk: torch.Tensor) -> None:
        self.chunks.append(chunk.clone())

    def finish(self) -> list[torch.Tensor]:
        return self.chunks


def test_each_worker_runs_its_torch_work_on_one_thread_whichever_thread_calls(
    tiny_model_dir: Path, work: list, reference: list
) -> None:
    # a second thread running parallel torch ops in a worker process makes libgomp stop
    # spinning (more pool threads than cores): every op of a step then waits for wake-ups
    transport = CarriedTransport()
    prefill = PrefillWorker(
        PrefillWorkerConfig(runner=runner(tiny_model_dir, "float32")), transport
    )
    decode = DecodeWorker(
        DecodeWorkerConfig(engine=EngineConfig(runner=runner(tiny_model_dir, "float32"))), transport
    )
    threads: dict[str, set[int]] = {"execute": set(), "import": set()}

    def recorded(name: str, fn):
        def call(*args, **kwargs):
            threads[name].add(threading.get_ident())
            return fn(*args, **kwargs)
        return call

    prefill.runner.execute = recorded("execute", prefill.runner.execute)
    kv_cache = decode.runner.kv_cache
    kv_cache.import_blocks = recorded("import", kv_cache.import_blocks)
    callers: set[int] = set()
    try:
        requests = [
            WorkerRequest(ServeRequest(f"r{i}", list(p), s), [])
            for i, (p, s) in enumerate(work[:2])
        ]

        def handoff(request: WorkerRequest) -> None:
            callers.add(threading.get_ident())
            blocks = -(-len(request.prompt_token_ids) // BLOCK_SIZE)
            reservation = decode.reserve([(request.request_id, blocks)])
            task = PrefillTask(0, [request], (1, 64, 0), True, reservation.handle, 512)
            result = prefill.run_batch(task)
            request.output_token_ids = list(result.first[0].token_ids)
            assert decode.admit_prefilled(reservation.lease_id, [request], result.payload).admitted
            assert prefill.release(result.lease_id)

        handoff(requests[0])  # from this thread
        other = threading.Thread(target=handoff, args=(requests[1],))
        other.start()
        other.join()
        assert len(callers) == 2
        assert len(threads["execute"]) == 1 and not threads["execute"] & callers
        assert threads["import"] == {decode._thread.ident}
        got = _drain(decode, requests)
        assert [got[r.request_id] for r in requests] == reference[:2]
    finally:
        prefill.shutdown()
        decode.shutdown()
