"""TP x PP in the service: `controller.decode.tensor_parallel_size: 2` with
`pipeline_parallel_size: 2` makes a colocated decode worker two stages of two ranks each.
On Ray with four fake Gaudi cards each rank of each stage holds a card of its own (the
worker's actor none), the tokens are one rank's, and a rank killed mid-request takes the
worker down, which comes back with every stage and rank and loses nothing."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from bucketserve.bucket_manager.config import BucketManagerConfig
from bucketserve.controller.config import PlacementConfig
from bucketserve.controller.stage_group import StageGroupPlacement
from bucketserve.controller.worker_pool import WorkerPool, _group_placement, worker_resources
from bucketserve.deploy.serve_config import ServeConfig
from tests.disagg.helpers import (
    assert_drained,
    controller_config,
    generate,
    generate_signalling,
    small_batches,
    tokens,
)

TP2_PP2 = PlacementConfig(
    accelerator="hpu", num_cpus=0.25, torch_threads=1, tensor_parallel_size=2,
    pipeline_parallel_size=2,
)  # fmt: skip


def test_tp2_pp2_loads_and_reaches_the_decode_worker_as_a_stage_group(
    tiny_model_dir: Path,
) -> None:
    config = ServeConfig.from_dict({
        "model": {"path": str(tiny_model_dir)},
        "controller": {"decode": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}},
    }).controller_config()  # fmt: skip
    decode = WorkerPool(config, BucketManagerConfig()).decode_config(0)
    assert decode.tensor_parallel_size == 2 and decode.pipeline_parallel_size == 2
    group = _group_placement(worker_resources(TP2_PP2, "hpu"), TP2_PP2)
    assert isinstance(group, StageGroupPlacement) and len(group.bundles()) == 5  # head + 4


@pytest.mark.slow  # a worker, two stage actors and two rank actors, started twice
def test_a_ray_tp2_pp2_decode_worker_takes_four_cards_matches_one_rank_and_survives_a_rank_kill(
    ray_cards: None, tiny_model_dir: Path, long_work: list, long_reference: list
) -> None:
    from bucketserve.controller.controller import Controller

    work, reference = long_work[:4], long_reference[:4]

    async def main() -> None:
        config = controller_config(
            tiny_model_dir, mode="ray", topology="colocated", buckets=small_batches(),
            decode=dict(TP2_PP2), prefill={"accelerator": "none"},
        )  # fmt: skip
        controller = Controller(config)
        await controller.start()
        try:
            info = controller.pool.infos["decode-0"]
            stages = info["stages"]
            assert [s["layers"] for s in stages] == [[0, 1], [1, 2]]
            assert "HPU" not in info["accelerator_ids"]  # the worker's actor holds no card
            cards = [s["accelerator_ids"]["HPU"] for s in stages]
            cards += [r["accelerator_ids"]["HPU"] for s in stages for r in s["ranks"]]
            assert sorted(c for ids in cards for c in ids) == ["0", "1", "2", "3"]
            assert len(info["rank_pids"]) == 2  # one other rank per stage

            handle = controller.pool.by_name("decode-0")
            first = asyncio.Event()
            run = asyncio.ensure_future(generate_signalling(controller, work, first))
            await first.wait()  # request 0 is streaming: stage 1's other rank dies
            os.kill(stages[1]["ranks"][0]["pid"], signal.SIGKILL)
            assert tokens(await run) == reference
            assert handle.restarts >= 1
            revived = await handle.call("info")
            assert len(revived["rank_pids"]) == 2
            assert not set(revived["rank_pids"]) & set(info["rank_pids"])
            assert tokens(await generate(controller, work[:2], "after")) == reference[:2]
            stats = await controller.drain(60)
        finally:
            await controller.shutdown()
        assert_drained(stats)

    asyncio.run(main())
