"""Tensor parallelism in the service: `controller.decode.tensor_parallel_size` reaches the
colocated decode worker's engine (its Ray actor the head rank, the other rank a RankActor
in the worker's placement group); what the service cannot run yet is refused at config
load; a colocated TP 2 worker gives the greedy tokens of one rank, and a rank killed
mid-request takes the worker down, which comes back with every rank and re-prefills its
requests, losing nothing."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bucketserve.bucket_manager.config import BucketManagerConfig
from bucketserve.controller.config import ControllerConfig, PlacementConfig
from bucketserve.controller.worker_pool import WorkerPool
from bucketserve.deploy.serve_config import ServeConfig
from bucketserve.deploy.serve_config_error import ServeConfigError
from tests.disagg.helpers import (
    assert_drained,
    controller_config,
    generate,
    generate_signalling,
    serve_and_drain,
    small_batches,
    tokens,
)

TP2 = PlacementConfig(accelerator="none", tensor_parallel_size=2)


# -- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("controller", "key", "message"), [
    ({"decode": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}},
     "controller.decode.tensor_parallel_size", "not both yet"),
    ({"shape": "disaggregated", "prefill": {"tensor_parallel_size": 2}},
     "controller.prefill.tensor_parallel_size", "needs the sharded P->D handoff"),
    ({"shape": "disaggregated", "decode": {"tensor_parallel_size": 2}},
     "controller.decode.tensor_parallel_size", "use controller.shape: colocated"),
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
    assert decode.engine.tensor_parallel_size == 2 and decode.prefills
    assert load(2).actor_resources("decode") == {"CPU": 2.0}  # both ranks
    # the tiny model has 4 attention heads: the runtime's own refusal, named by the key
    with pytest.raises(ServeConfigError, match=r"controller\.decode\.tensor_parallel_size: "
                       r"tensor_parallel_size 3 does not split this model: num_attention_heads 4"):
        load(3).controller_config()
    with pytest.raises(ValueError, match="needs the sharded P->D handoff"):
        ControllerConfig(shape="disaggregated", decode_placement=TP2)


# -- Ray -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    import ray

    ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def tp_config(model_dir: Path, tp: int, **options: Any) -> ControllerConfig:
    placement = PlacementConfig(accelerator="none", tensor_parallel_size=tp)
    return controller_config(
        model_dir, mode="ray", shape="colocated", buckets=small_batches(),
        decode_placement=placement, prefill_placement=PlacementConfig(accelerator="none"),
        **options,
    )  # fmt: skip


@pytest.mark.slow
def test_a_colocated_tp2_decode_worker_gives_the_greedy_tokens_of_one_rank(
    ray_session: None, tiny_model_dir: Path, work: list, reference: list
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
    ray_session: None, tiny_model_dir: Path, long_work: list, long_reference: list
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
