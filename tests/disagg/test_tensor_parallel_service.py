"""Tensor parallelism in the service: `controller.decode.tensor_parallel_size` reaches the
colocated decode worker's engine (its Ray actor the head rank, the other rank a RankActor
in the worker's placement group); what the service cannot run yet is refused at config
load; a colocated TP 2 worker gives the greedy tokens of one rank, and a rank killed
mid-request takes the worker down, which comes back with every rank and re-prefills its
requests, losing nothing. Disaggregated, TP 2 prefill -> TP 2 decode: each prefill rank
ships its KV heads to the decode rank of its index (split heads over Ray's object store,
replicated ones over the collective transport), and a prefill or decode rank killed
mid-request loses nothing either."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from bucketserve.bucket_manager.config import BucketManagerConfig
from bucketserve.controller.config import ControllerConfig
from bucketserve.controller.worker_pool import WorkerPool
from bucketserve.deploy.serve_config import ServeConfig
from bucketserve.deploy.serve_config_error import ServeConfigError
from bucketserve.kv_transfer.kv_format import KVBlockHandle, KVFormat
from bucketserve.kv_worker.rank_kv import check_ranks
from tests.disagg.helpers import (
    BLOCK_SIZE,
    assert_drained,
    controller_config,
    generate,
    generate_signalling,
    reference_outputs,
    serve_and_drain,
    small_batches,
    tokens,
)

TP2 = {"accelerator": "none", "tensor_parallel_size": 2}


# -- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("controller", "key", "message"), [
    ({"topology": "disaggregated",
      "prefill": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
      "decode": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}},
     "controller.prefill.tensor_parallel_size", "stage groups hand KV over through their heads"),
    ({"topology": "disaggregated", "prefill": {"tensor_parallel_size": 2},
      "decode": {"tensor_parallel_size": 4}},
     "controller.decode.tensor_parallel_size",
     "controller.prefill.tensor_parallel_size 2 and controller.decode.tensor_parallel_size 4 "
     "differ: each prefill rank hands its KV heads to the decode rank of the same index, so "
     "set both to 2 or both to 4"),
    ({"topology": "disaggregated", "prefill": {"tensor_parallel_size": 4},
      "decode": {"tensor_parallel_size": 2}},
     "controller.decode.tensor_parallel_size", "set both to 4 or both to 2"),
    ({"topology": "disaggregated", "decode": {"tensor_parallel_size": 2}},
     "controller.decode.tensor_parallel_size", "controller.prefill.tensor_parallel_size 1 and"),
    ({"topology": "disaggregated", "mode": "local", "prefill": {"tensor_parallel_size": 2},
      "decode": {"tensor_parallel_size": 2}},
     "controller.prefill.tensor_parallel_size", "needs controller.mode: ray"),
    ({"decode": {"tensor_parallel_size": 0}},
     "controller.decode.tensor_parallel_size", "must be an integer >= 1, got 0"),
])  # fmt: skip
def test_what_the_service_cannot_run_with_ranks_is_refused_at_load(
    controller: dict, key: str, message: str
) -> None:
    with pytest.raises(ServeConfigError) as caught:
        ServeConfig.from_dict({"controller": controller})
    assert caught.value.path == key
    assert message in str(caught.value)


def test_colocated_decode_ranks_reach_the_engine_and_a_model_that_cannot_split_is_refused(
    tiny_model_dir: Path,
) -> None:
    def load(tp: int) -> ServeConfig:
        return ServeConfig.from_dict({
            "model": {"path": str(tiny_model_dir)},
            "controller": {"decode": {"tensor_parallel_size": tp},
                           # a colocated service ignores its prefill settings
                           "prefill": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}},
        })  # fmt: skip

    config = load(2).controller_config()
    decode = WorkerPool(config, BucketManagerConfig()).decode_config(0)
    assert decode.tensor_parallel_size == 2 and decode.prefills
    assert load(2).actor_resources("decode") == {"CPU": 2.0}  # both ranks
    # the tiny model has 4 attention heads: the runtime's own refusal, named by the key
    with pytest.raises(ServeConfigError, match=r"controller\.decode\.tensor_parallel_size: "
                       r"tensor_parallel_size 3 does not split this model: num_attention_heads 4"):
        load(3).controller_config()
    with pytest.raises(ValueError, match=r"controller\.prefill\.tensor_parallel_size 1 and "
                       r"controller\.decode\.tensor_parallel_size 2 differ"):
        ControllerConfig(topology="disaggregated", decode=TP2)
    with pytest.raises(ValueError, match=r"needs controller\.mode: ray"):
        ControllerConfig(topology="disaggregated", mode="local", prefill=TP2, decode=TP2)
    disaggregated = ServeConfig.from_dict({
        "model": {"path": str(tiny_model_dir)},
        "controller": {"topology": "disaggregated", "prefill": {"tensor_parallel_size": 2},
                       "decode": {"tensor_parallel_size": 2}},
    })  # fmt: skip
    pool = WorkerPool(disaggregated.controller_config(), BucketManagerConfig())
    assert pool.prefill_config(0).tensor_parallel_size == 2
    assert pool.decode_config(0).tensor_parallel_size == 2
    assert disaggregated.actor_resources("prefill") == {"CPU": 2.0}


def test_a_rank_pool_format_names_its_kv_heads_and_a_mismatched_shard_is_refused() -> None:
    def shard(heads: int, offset: int) -> KVFormat:
        return KVFormat("float32", 4, 2, heads, 16, kv_head_offset=offset)

    shard(1, 1).check_compatible(shard(1, 1))
    with pytest.raises(ValueError, match="kv_head_offset 1 vs 0"):  # another rank's heads
        shard(1, 1).check_compatible(shard(1, 0))
    with pytest.raises(ValueError, match="num_kv_heads 1 vs 2"):  # TP 2 into TP 1
        shard(1, 0).check_compatible(shard(2, 0))
    handle = KVBlockHandle("decode-0", "lease-0", ("r0",), ((3, 4, 5),), shard(1, 0), (1,),
                           rank_formats=(shard(1, 0), shard(1, 1)))  # fmt: skip
    rank1 = handle.for_rank(1)
    assert handle.num_ranks == 2 and rank1.format == shard(1, 1)
    assert rank1.transfer_block_ids == handle.transfer_block_ids == [4, 5]  # same blocks
    check_ranks(2, handle)
    with pytest.raises(ValueError, match=r"decode worker decode-0 2: .* must be equal"):
        check_ranks(1, handle)
    with pytest.raises(ValueError, match="must start with its own format"):
        KVBlockHandle("d", "l", ("r",), ((1,),), shard(1, 1), rank_formats=(shard(1, 0),))


def test_a_rank_ships_its_shard_with_the_step_it_was_begun_for() -> None:
    """RankKV over a real pool and the in-process transport: the next step's hook ships the
    begun batch's blocks layer by layer; a batch whose step shipped only some layers, or
    whose sender could not be built, fails at `finish` instead of inside the forward."""
    import types

    import torch

    from bucketserve.kv_transfer.inprocess import InProcessTransport
    from bucketserve.kv_transfer.transport import TransferError
    from bucketserve.kv_worker.rank_kv import RankKV
    from bucketserve.runtime.worker.kv_cache import KVCache

    pool = KVCache(2, 8, 4, 1, 16, torch.float32)
    for layer in range(2):
        pool.k[layer].uniform_()
        pool.v[layer].uniform_()
    got: list[tuple[int, torch.Tensor]] = []
    receiver = types.SimpleNamespace(receive_kv=lambda lease, layer, chunk: got.append(
        (layer, chunk.clone())))  # fmt: skip
    transport = InProcessTransport()
    transport.register("decode-0", receiver)
    rank = RankKV("prefill-0", 1, types.SimpleNamespace(kv_cache=pool, tp=None))
    rank.transport = transport
    fmt = rank.format
    handle = KVBlockHandle("decode-0", "lease-0", ("r0",), ((2, 5),), fmt)

    assert rank.step_hook() is None  # no batch begun: a step ships nothing
    rank.begin_send(7, handle, [2, 5])
    hook = rank.step_hook()
    assert rank.step_hook() is None  # only the next step ships it
    for layer in range(2):
        hook(layer)
    assert rank.finish(7) == 2
    assert [layer for layer, _ in got] == [0, 1]
    assert torch.equal(got[1][1], pool.export_blocks(1, [2, 5]))
    rank.close(7)

    rank.begin_send(8, handle, [2, 5])
    rank.step_hook()(0)  # the step stopped after one layer
    with pytest.raises(TransferError, match="1 of 2 layers were shipped"):
        rank.finish(8)
    rank.begin_send(9, dataclasses.replace(handle, decode_worker="decode-9"), [2, 5])
    assert rank.step_hook() is None
    with pytest.raises(TransferError, match="not registered"):
        rank.finish(9)


# -- Ray -------------------------------------------------------------------------------------


def tp_config(model_dir: Path, tp: int, **options: Any) -> ControllerConfig:
    placement = {"accelerator": "none", "tensor_parallel_size": tp}
    return controller_config(
        model_dir, mode="ray", topology="colocated", buckets=small_batches(),
        decode=placement, prefill={"accelerator": "none"},
        **options,
    )  # fmt: skip


@pytest.mark.slow
def test_a_colocated_tp2_decode_worker_gives_the_greedy_tokens_of_one_rank(
    ray_cards: None, tiny_model_dir: Path, work: list, reference: list
) -> None:
    import ray

    from bucketserve.controller.controller import Controller

    async def main() -> None:
        controller = Controller(tp_config(tiny_model_dir, 2))
        await controller.start()
        assert len(controller.pool.infos["decode-0"]["rank_pids"]) == 1  # the other rank
        assert [n for n in ray.util.list_named_actors() if n.endswith("-rank1")]  # an actor
        outputs, _ = await serve_and_drain(controller, work[:8], "tp2")
        assert outputs == reference[:8]

    asyncio.run(main())


@pytest.mark.slow
def test_a_rank_killed_mid_request_restarts_its_worker_and_loses_nothing(
    ray_cards: None, tiny_model_dir: Path, long_work: list, long_reference: list
) -> None:
    from bucketserve.controller.controller import Controller

    async def main() -> None:
        controller = Controller(tp_config(tiny_model_dir, 2))
        await controller.start()
        try:
            handle = controller.pool.by_name("decode-0")
            (rank_pid,) = controller.pool.infos["decode-0"]["rank_pids"]
            first = asyncio.Event()
            run = asyncio.ensure_future(generate_signalling(controller, long_work[:6], first))
            await first.wait()  # request 0 is streaming: the other rank dies mid-request
            os.kill(rank_pid, signal.SIGKILL)
            outputs = tokens(await run)
            assert outputs == long_reference[:6]
            assert handle.restarts >= 1
            info = await handle.call("info")
            assert len(info["rank_pids"]) == 1 and info["rank_pids"] != [rank_pid]
            assert tokens(await generate(controller, long_work[:2], "after")) == (
                long_reference[:2]
            )
            assert_drained(await controller.drain(30))
        finally:
            await controller.shutdown()

    asyncio.run(main())


# -- disaggregated ---------------------------------------------------------------------------


@pytest.mark.slow
def test_disaggregated_tp2_ranks_hand_their_kv_shards_to_the_matching_decode_ranks_and_survive_rank_kills(  # noqa: E501
    ray_cards: None, tiny_model_dir: Path, work: list, reference: list, long_work: list,
    long_reference: list,
) -> None:
    """Two KV heads over two ranks: decode rank 1's pool holds only head 1, which only
    prefill rank 1 computed, so the tokens match one rank's only if each shard arrived."""
    from bucketserve.controller.controller import Controller

    ranks = {"accelerator": "hpu", "num_cpus": 0.25, "tensor_parallel_size": 2}

    async def main() -> None:
        config = controller_config(
            tiny_model_dir, mode="ray", buckets=small_batches(), prefill=ranks, decode=ranks,
        )  # fmt: skip
        controller = Controller(config)
        await controller.start()
        try:
            infos = controller.pool.infos
            cards = []
            for name in ("prefill-0", "decode-0"):
                formats = infos[name]["rank_kv_formats"]
                assert [(f.kv_head_offset, f.num_kv_heads) for f in formats] == [(0, 1), (1, 1)]
                (rank,) = infos[name]["ranks"]
                cards += infos[name]["accelerator_ids"]["HPU"] + rank["accelerator_ids"]["HPU"]
            assert sorted(cards) == ["0", "1", "2", "3"]  # a card per rank, none shared

            assert tokens(await generate(controller, work[:8], "tp2")) == reference[:8]
            sent = (await controller.drain(30)).worker("prefill-0").kv_bytes_sent
            # the decode pools' prefix caches hold these now: only the blocks they lack travel
            assert tokens(await generate(controller, work[:4], "again")) == reference[:4]
            stats = await controller.drain(30)
            assert_drained(stats)
            shard = infos["prefill-0"]["kv_format"]
            blocks = sum(-(-len(prompt) // BLOCK_SIZE) for prompt, _ in work[:4])
            whole = blocks * shard.chunk_bytes(1) * shard.num_layers * 2  # both ranks' shards
            assert 0 < stats.worker("prefill-0").kv_bytes_sent - sent < whole

            first = asyncio.Event()  # a decode rank dies while request 0 streams
            run = asyncio.ensure_future(generate_signalling(controller, long_work[:6], first))
            await first.wait()
            os.kill(infos["decode-0"]["rank_pids"][0], signal.SIGKILL)
            assert tokens(await run) == long_reference[:6]

            prefill = controller.pool.by_name("prefill-0")  # a prefill rank, mid-batch
            run = asyncio.ensure_future(generate(controller, long_work[:6], "prefill-kill"))
            for _ in range(10_000):
                if prefill.inflight:
                    break
                await asyncio.sleep(0.001)
            os.kill(infos["prefill-0"]["rank_pids"][0], signal.SIGKILL)
            assert tokens(await run) == long_reference[:6]
            # if it died after the last batch, the next one finds it gone
            assert tokens(await generate(controller, work[:4], "after")) == reference[:4]
            stats = await controller.drain(60)
        finally:
            await controller.shutdown()
        assert_drained(stats)
        assert stats.worker("decode-0").restarts == 1
        assert stats.worker("prefill-0").restarts == 1

    asyncio.run(main())


@pytest.mark.slow
def test_disaggregated_tp2_with_replicated_kv_heads_over_the_collective_transport(
    ray_cards: None, tiny_model_factory: Any, work: list
) -> None:
    """One KV head on two ranks: each rank holds a copy; every rank pair has its own gloo
    group, so rank 1's copy reaches decode rank 1 without passing through rank 0."""
    from bucketserve.controller.controller import Controller

    model = tiny_model_factory(num_key_value_heads=1)
    reference = reference_outputs(model, work[:8])

    async def main() -> None:
        config = controller_config(
            model, mode="ray", transport="collective", buckets=small_batches(),
            prefill=TP2, decode=TP2,
        )  # fmt: skip
        controller = Controller(config)
        await controller.start()
        formats = controller.pool.infos["decode-0"]["rank_kv_formats"]
        assert [(f.kv_head_offset, f.num_kv_heads) for f in formats] == [(0, 1), (0, 1)]
        outputs, stats = await serve_and_drain(controller, work[:8], "replicated")
        assert outputs == reference
        assert {w.transport for w in stats.workers} == {"collective"}
        assert stats.worker("prefill-0").kv_bytes_sent > 0

    asyncio.run(main())
