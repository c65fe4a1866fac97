"""Prefix caching in the disaggregated topology: the prefill worker computes only what its cache
lacks, the handoff ships only the blocks the decode worker lacks, and every token is the one
the cache-off run gives (prompts sharing 0, 1 or many blocks, partial last blocks), on every
transport, padded or not, across a worker kill; after drain every block is free or cached."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from bucketserve.controller.config import ControllerConfig
from bucketserve.controller.controller import Controller
from bucketserve.decode_worker.config import DecodeWorkerConfig
from bucketserve.decode_worker.decode_worker import DecodeWorker
from bucketserve.kv_transfer.collective import CollectivePayload, CollectiveTransport, PairSpec
from bucketserve.kv_transfer.collective_group import RECEIVER_RANK, SENDER_RANK
from bucketserve.kv_transfer.inprocess import InProcessTransport
from bucketserve.kv_transfer.kv_format import KVBlockHandle
from bucketserve.kv_transfer.transport import TransferError
from bucketserve.messages import PrefillResult, PrefillTask, ServeRequest, WorkerRequest
from bucketserve.prefill_worker.config import PrefillWorkerConfig
from bucketserve.prefill_worker.prefill_worker import PrefillWorker
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.engine.engine_config import EngineConfig
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from tests.disagg.helpers import (
    BLOCK_SIZE,
    NUM_KV_BLOCKS,
    assert_drained,
    controller_config,
    generate,
    generate_killing,
    small_batches,
    tokens,
)
from tests.disagg.test_collective import FMT as CHUNK_FMT
from tests.disagg.test_collective import chunks, connect, receive, same, send
from tests.disagg.test_kv_transfer import CarriedTransport, _drain

BLOCK = BLOCK_SIZE
GREEDY = SamplingParams(temperature=0, max_tokens=8)
POOL = 128  # blocks of each worker's pool in the worker-level tests


def shared_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(3, 49152) for _ in range(n)]  # noqa: E731
    system = words(8 * BLOCK + 2)  # many full blocks and a partial one
    one = words(BLOCK)
    first = system + words(5)
    return [
        first,
        system + words(3),  # the shared blocks, then its own
        system[: 8 * BLOCK] + words(1),  # ends right after the shared blocks
        one + words(6),
        one + words(2),  # one shared block
        words(7),  # shares nothing
        system + system[-2:],  # the shared blocks, then its own partial block
        list(first),  # all of it again: every block but the one holding its last token
    ]


# leading blocks each of shared_prompts finds cached when they run one after another
CACHED_ONE_AT_A_TIME = [0, 8, 8, 0, 1, 0, 8, 9]


def engine_reference(model_dir: Path, work: list[tuple[list[int], SamplingParams]]) -> list:
    """The in-process engine's tokens with the prefix cache off."""
    from bucketserve.runtime.engine.llm import LLM

    llm = LLM(
        str(model_dir), block_size=BLOCK, num_kv_blocks=NUM_KV_BLOCKS, enable_prefix_caching=False
    )
    outs = llm.generate([p for p, _ in work], [s for _, s in work], use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def shared_reference(tiny_model_dir: Path) -> list[list[int]]:
    return engine_reference(tiny_model_dir, [(p, GREEDY) for p in shared_prompts()])


# -- one prefill worker and one decode worker, called directly ---------------------------------


def runner(model_dir: Path, execution: str = "eager", caching: bool = True) -> ModelRunnerConfig:
    return ModelRunnerConfig(
        model=str(model_dir), dtype="float32", block_size=BLOCK, num_kv_blocks=POOL,
        execution=execution, enable_prefix_caching=caching,
    )  # fmt: skip


def workers(
    model_dir: Path, transport: str, prefill_mode: str, caching: bool
) -> tuple[PrefillWorker, DecodeWorker]:
    """A prefill (eager unpadded, eager padded or graphs) and an eager decode worker joined
    by `transport`: inprocess, carried (the object store's shape: KV rides with the payload)
    or collective (a gloo pair group)."""
    shared = {"inprocess": InProcessTransport(), "carried": CarriedTransport()}.get(transport)
    prefill = PrefillWorker(
        PrefillWorkerConfig(
            runner=runner(model_dir, "graphs" if prefill_mode == "graphs" else "eager", caching),
            transport="inprocess",
            pad_to_shape_buckets=prefill_mode != "eager",
        ),
        shared,
    )
    decode = DecodeWorker(
        DecodeWorkerConfig(
            engine=EngineConfig(runner=runner(model_dir, caching=caching)),
            transport="inprocess",
        ),
        shared,
    )
    if transport == "inprocess":
        shared.register(decode.name, decode)
    elif transport == "collective":
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        sides = [
            (prefill, PairSpec(decode.name, "p0d0/", SENDER_RANK)),
            (decode, PairSpec(prefill.name, "p0d0/", RECEIVER_RANK)),
        ]
        threads = [
            threading.Thread(target=w.init_collective, args=("127.0.0.1", store.port, [s], 30.0))
            for w, s in sides
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert prefill.transport.name == decode.transport.name == "collective"
    return prefill, decode


def handoff(
    prefill: PrefillWorker, decode: DecodeWorker, request: WorkerRequest, graph_miss: bool
) -> tuple[KVBlockHandle, PrefillResult]:
    """Reserve (naming the tokens), prefill into the reservation, admit, acknowledge."""
    token_ids = [*request.prompt_token_ids, *request.output_token_ids]
    need = [(request.request_id, -(-len(token_ids) // BLOCK))]
    reservation = decode.reserve(need, None, [token_ids])
    task = PrefillTask(0, [request], (1, 64, 0), graph_miss, reservation.handle, 512)
    result = prefill.run_batch(task)
    request.output_token_ids = [*request.output_token_ids, *result.first[0].token_ids]
    ack = decode.admit_prefilled(reservation.lease_id, [request], result.payload)
    assert ack.admitted == [request.request_id] and not ack.rejected
    assert ack.kv_bytes == result.kv_bytes
    assert prefill.release(result.lease_id)
    return reservation.handle, result


def computed_tokens(prefill: PrefillWorker) -> list[list[int]]:
    """Each prefill batch's tokens computed per sequence, as the runner was asked for them."""
    calls: list[list[int]] = []
    real = prefill.runner.execute

    def execute(seqs, num_new_tokens, *args, **kwargs):
        calls.append(list(num_new_tokens))
        return real(seqs, num_new_tokens, *args, **kwargs)

    prefill.runner.execute = execute
    return calls


def assert_pools_whole(prefill: PrefillWorker, decode: DecodeWorker) -> None:
    for worker in (prefill, decode):
        stats = worker.stats()
        assert stats.num_free_blocks == stats.num_total_blocks == POOL, stats
        assert stats.leases_open == 0 and stats.reserved_blocks == 0, stats


@pytest.mark.parametrize(
    ("transport", "prefill_mode"),
    [
        ("inprocess", "eager"),
        ("carried", "eager"),
        ("collective", "eager"),
        ("inprocess", "padded"),
        ("inprocess", "graphs"),
    ],
)
def test_a_cached_prefix_is_computed_and_shipped_once(
    tiny_model_dir: Path, shared_reference: list, transport: str, prefill_mode: str
) -> None:
    """One request after another: each computes on the prefill worker only the tokens after
    its cached leading blocks, the decode worker's reservation reports the same blocks as
    held, only the others travel, and the tokens are the cache-off engine's."""
    prefill, decode = workers(tiny_model_dir, transport, prefill_mode, caching=True)
    computed = computed_tokens(prefill)
    chunk = decode.kv_format.chunk_bytes(1) * decode.kv_format.num_layers  # one block's KV
    try:
        prompts = shared_prompts()
        requests = [
            WorkerRequest(ServeRequest(f"r{i}", list(p), GREEDY), [])
            for i, p in enumerate(prompts)
        ]
        cached, sent, got = [], [], []
        for request in requests:
            handle, result = handoff(prefill, decode, request, prefill_mode == "eager")
            cached.append(handle.num_cached_blocks[0])
            sent.append(result.kv_bytes // chunk)
            assert result.first[0].num_cached_tokens == cached[-1] * BLOCK
            got.append(_drain(decode, [request])[request.request_id])
        assert cached == CACHED_ONE_AT_A_TIME
        blocks = [-(-len(p) // BLOCK) for p in prompts]
        assert sent == [b - c for b, c in zip(blocks, cached, strict=True)]
        assert computed == [[len(p) - c * BLOCK] for p, c in zip(prompts, cached, strict=True)]
        assert got == shared_reference
        assert prefill.block_manager.prefix_cache_hits == sum(cached) * BLOCK
        assert_pools_whole(prefill, decode)
        assert prefill.block_manager.num_cached_blocks > 0
        assert decode.block_manager.num_cached_blocks > 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_with_the_cache_off_every_block_is_computed_and_sent(
    tiny_model_dir: Path, shared_reference: list
) -> None:
    prefill, decode = workers(tiny_model_dir, "inprocess", "eager", caching=False)
    computed = computed_tokens(prefill)
    try:
        prompts = shared_prompts()
        requests = [
            WorkerRequest(ServeRequest(f"r{i}", list(p), GREEDY), [])
            for i, p in enumerate(prompts)
        ]
        got = []
        for request in requests:
            handle, result = handoff(prefill, decode, request, True)
            assert handle.num_cached_blocks == (0,)
            layers = decode.kv_format.num_layers
            assert result.kv_bytes == decode.kv_format.chunk_bytes(handle.num_blocks) * layers
            got.append(_drain(decode, [request])[request.request_id])
        assert computed == [[len(p)] for p in prompts]
        assert got == shared_reference
        assert_pools_whole(prefill, decode)
        assert prefill.block_manager.num_cached_blocks == 0
        assert decode.block_manager.num_cached_blocks == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_one_batch_of_requests_sharing_a_prefix_and_a_released_reservation(
    tiny_model_dir: Path, shared_reference: list
) -> None:
    """A batch whose requests find different cached prefixes on each side: each request's
    own blocks travel; a reservation released unused gives its cached blocks back too."""
    prefill, decode = workers(tiny_model_dir, "inprocess", "eager", caching=True)
    computed = computed_tokens(prefill)
    try:
        prompts = shared_prompts()
        warm = WorkerRequest(ServeRequest("warm", list(prompts[0]), GREEDY), [])
        handoff(prefill, decode, warm, True)
        _drain(decode, [warm])
        # two requests holding the same cached blocks under one lease, released unused
        pair = [prompts[1], prompts[7]]
        unused = decode.reserve(
            [(f"x{i}", -(-len(p) // BLOCK)) for i, p in enumerate(pair)], None, pair
        )
        assert unused.handle.num_cached_blocks == (8, 9)
        assert unused.handle.block_ids[0][:8] == unused.handle.block_ids[1][:8]
        assert decode.release(unused.lease_id)
        assert_pools_whole(prefill, decode)
        assert all(decode.block_manager.ref_count(b) == 0 for b in unused.handle.flat_block_ids)

        batch = [1, 4, 7, 6]
        requests = [
            WorkerRequest(ServeRequest(f"b{i}", list(prompts[i]), GREEDY), []) for i in batch
        ]
        need = [(r.request_id, -(-len(r.prompt_token_ids) // BLOCK)) for r in requests]
        reservation = decode.reserve(need, None, [r.prompt_token_ids for r in requests])
        assert reservation.handle.num_cached_blocks == (8, 0, 9, 8)  # as the prefill finds
        held = decode.block_manager
        shared = reservation.handle.block_ids[0][:8]
        assert all(held.ref_count(b) == 3 for b in shared)  # requests 1, 7 and 6
        computed.clear()
        task = PrefillTask(1, requests, (4, 64, 0), True, reservation.handle, 512)
        result = prefill.run_batch(task)
        hits = (8, 0, 9, 8)
        assert computed == [[len(prompts[i]) - c * BLOCK for i, c in zip(batch, hits, strict=True)]]
        sent = sum(-(-len(prompts[i]) // BLOCK) for i in batch) - sum(hits)
        assert result.kv_bytes == decode.kv_format.chunk_bytes(sent) * decode.kv_format.num_layers
        for request, first in zip(requests, result.first, strict=True):
            request.output_token_ids = list(first.token_ids)
        # request b6 was cancelled meanwhile: its blocks (cached ones too) are given back
        ack = decode.admit_prefilled(reservation.lease_id, requests[:3], result.payload)
        assert ack.admitted == ["b1", "b4", "b7"]
        assert prefill.release(result.lease_id)
        got = _drain(decode, requests[:3])
        assert [got[r.request_id] for r in requests[:3]] == [shared_reference[i] for i in batch[:3]]
        assert_pools_whole(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_the_collective_stream_carries_only_the_blocks_each_side_lacks() -> None:
    """Sender and receiver agree on each batch's block count from the handle alone: a
    batch aborted mid-way, another claimed out of order, both with cached blocks."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    p, d = CollectiveTransport("prefill-0"), CollectiveTransport("decode-0")
    connect(store, [(p, d)])
    fmt = CHUNK_FMT
    ha = KVBlockHandle("decode-0", "a", ("a0", "a1"), ((0, 1, 2), (0, 1, 3, 4)), fmt, (2, 2))
    hb = KVBlockHandle("decode-0", "b", ("b0",), ((0, 5),), fmt, (1,))
    hc = KVBlockHandle("decode-0", "c", ("c0",), ((6, 7),), fmt)
    assert (ha.transfer_block_ids, hb.transfer_block_ids) == ([2, 3, 4], [5])
    assert (ha.num_transfer_blocks, hb.num_transfer_blocks, hc.num_transfer_blocks) == (3, 1, 2)
    failed = p.sender(ha, fmt)
    failed.send_layer(0, chunks(3, seed=1)[0])
    failed.abort()
    pb, pc = send(p, hb, chunks(1, seed=2)), send(p, hc, chunks(2, seed=3))
    assert same(receive(d, hc, pc), chunks(2, seed=3))  # a and b read off the wire first
    assert same(receive(d, hb, pb), chunks(1, seed=2))
    with pytest.raises(TransferError, match="aborted"):
        receive(d, ha, CollectivePayload("prefill-0", failed.seq, "float32"))
    with pytest.raises(ValueError, match="at least one block to send"):
        KVBlockHandle("decode-0", "x", ("x0",), ((0, 1),), fmt, (2,))


# -- the whole service, local mode --------------------------------------------------------------


def service_work(max_tokens: int, ignore_eos: bool = False) -> list[tuple[list[int], Any]]:
    """The shared prompts and more of each kind, so batches find prefixes others left."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    prompts = shared_prompts(0) + shared_prompts(1) + shared_prompts(0)[1:5]
    return [(p, params) for p in prompts]


def caching_config(model_dir: Path, caching: bool, **options: Any) -> ControllerConfig:
    config = controller_config(model_dir, mode="local", buckets=small_batches(), **options)
    runner = config.runner.model_copy(update={"enable_prefix_caching": caching})
    return config.model_copy(update={"runner": runner})


async def two_waves(config: ControllerConfig, work: list) -> tuple[list, Any, dict[str, int]]:
    """`work` twice, the second wave after the first finished; the tokens of both, the
    drained stats and each worker's cached block count."""
    controller = Controller(config)
    await controller.start()
    try:
        first = tokens(await generate(controller, work, "first"))
        second = tokens(await generate(controller, work, "second"))
        stats = await controller.drain(30)
        cached = {
            name: controller.pool.by_name(name).worker.block_manager.num_cached_blocks
            for name in ("prefill-0", "decode-0")
        }
    finally:
        await controller.shutdown()
    assert_drained(stats)
    return [first, second], stats, cached


@pytest.mark.parametrize("padded", [False, True])
def test_the_service_gives_the_tokens_of_the_cache_off_run(tiny_model_dir: Path, padded: bool):
    work = service_work(8)
    reference = engine_reference(tiny_model_dir, work)
    options = {"pad_to_shape_buckets": padded, "warmup": "none"}

    async def main() -> None:
        off, off_stats, off_cached = await two_waves(
            caching_config(tiny_model_dir, False, **options), work
        )
        on, on_stats, on_cached = await two_waves(
            caching_config(tiny_model_dir, True, **options), work
        )
        assert off == on == [reference, reference]
        assert off_cached == {"prefill-0": 0, "decode-0": 0}
        assert on_cached["prefill-0"] > 0 and on_cached["decode-0"] > 0
        assert off_stats.worker("prefill-0").prefix_cache_hits == 0
        # the second wave finds every prompt's blocks but its last one cached
        assert on_stats.worker("prefill-0").prefix_cache_hits >= sum(
            (len(p) - 1) // BLOCK * BLOCK for p, _ in work
        )
        assert on_stats.kv_bytes_moved < off_stats.kv_bytes_moved
        assert on_stats.requests_requeued == off_stats.requests_requeued == 0

    asyncio.run(main())


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_killed_worker_with_cached_prefixes_loses_no_token(tiny_model_dir: Path, role: str):
    """Caches warm on both workers, then a worker is killed mid-request: re-queued requests
    are re-prefilled (over what the prefill worker still caches) and every stream gives the
    cache-off engine's tokens."""
    work = service_work(48, ignore_eos=True)
    reference = engine_reference(tiny_model_dir, work)

    async def main() -> None:
        controller = Controller(caching_config(tiny_model_dir, True))
        await controller.start()
        try:
            assert tokens(await generate(controller, work, "warm")) == reference
            assert tokens(await generate_killing(controller, work, role)) == reference
            stats = await controller.drain(30)
        finally:
            await controller.shutdown()
        assert_drained(stats)
        assert stats.worker(f"{role}-0").restarts == 1
        if role == "decode":
            assert stats.requests_requeued >= 1
            assert stats.worker("prefill-0").prefix_cache_hits > 0

    asyncio.run(main())
