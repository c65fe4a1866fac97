"""On a joined cluster the launcher waits `placement_timeout_s` for Ray to place the workers
(an autoscaler adding nodes meanwhile), then serves with those placed and names the rest."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from bucketserve.bucket_manager.config import BucketManagerConfig
from bucketserve.controller.config import ControllerConfig
from bucketserve.controller.local_ray import init_local
from bucketserve.controller.worker_handle import WorkerHandle
from bucketserve.controller.worker_pool import WorkerPool


class PendingOrPlaced(WorkerHandle):
    """A Ray actor stand-in: `start` answers at once when placed, never when pending."""

    def __init__(self, name: str, placed: bool) -> None:
        super().__init__(name, name.split("-")[0])
        self.placed = placed
        self.stopped = False

    async def start(self) -> None:
        if not self.placed:
            await asyncio.Event().wait()

    async def stop(self) -> None:
        self.stopped = True

    async def _call(self, method: str, *args: Any) -> Any:
        raise AssertionError("not called while placing")

    async def kill(self) -> None:
        raise AssertionError("not called while placing")


def place(*workers: tuple[str, bool]) -> tuple[list[str], list[PendingOrPlaced]]:
    pool = WorkerPool(ControllerConfig(placement_timeout_s=0.2), BucketManagerConfig())
    handles = [PendingOrPlaced(name, placed) for name, placed in workers]
    placed = asyncio.run(pool._placed(list(handles)))
    return [h.name for h in placed], handles


def test_all_placed_are_all_kept() -> None:
    names, handles = place(("prefill-0", True), ("decode-0", True), ("decode-1", True))
    assert names == ["prefill-0", "decode-0", "decode-1"]
    assert not any(h.stopped for h in handles)


def test_the_service_starts_with_the_workers_placed_and_names_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="bucketserve.controller.worker_pool"):
        names, handles = place(("prefill-0", True), ("decode-0", True), ("decode-1", False))
    assert names == ["prefill-0", "decode-0"]
    assert [h.name for h in handles if h.stopped] == ["decode-1"]  # its pending actor goes
    assert "starting with 2 of 3 workers: decode-1 not placed within 0.2s" in caplog.text


def test_no_worker_of_a_role_placed_is_an_error() -> None:
    with pytest.raises(RuntimeError, match=r"decode-0, decode-1 after 0\.2s.*every decode"):
        place(("prefill-0", True), ("decode-0", False), ("decode-1", False))


def test_a_worker_that_fails_to_start_fails_the_start() -> None:
    class Broken(PendingOrPlaced):
        async def start(self) -> None:
            raise ValueError("model not found")

    pool = WorkerPool(ControllerConfig(placement_timeout_s=0.2), BucketManagerConfig())
    with pytest.raises(ValueError, match="model not found"):
        asyncio.run(pool._placed([PendingOrPlaced("prefill-0", True),
                                      Broken("decode-0", True)]))


@pytest.mark.parametrize(
    ("types", "collective"),
    [(["cuda", "cuda"], True), (["hpu", "hpu"], True), (["cpu", "cpu"], False),
     (["cuda", "cpu"], False), (["cuda", "hpu"], False)],
)
def test_auto_transport_is_collective_only_when_every_worker_is_on_one_accelerator_kind(
    types: list[str], collective: bool
) -> None:
    pool = WorkerPool(ControllerConfig(), BucketManagerConfig())
    pool.infos = {f"w-{i}": {"device": f"Device({t}:0)", "device_type": t, "node_id": "n",
                             "role": ("prefill", "decode")[i],
                             "accelerator_ids": {t.upper(): [str(i)]}}
                  for i, t in enumerate(types)}
    assert pool._all_on_accelerators() is collective


@pytest.mark.parametrize(
    ("placed", "collective"),
    [
        ([("n1", ["0"]), ("n1", ["1"])], True),  # two GPUs of one node
        ([("n1", ["0"]), ("n2", ["0"])], True),  # GPU 0 of two nodes
        ([("n1", ["0"]), ("n1", ["0"])], False),  # halves of one GPU: NCCL's "Duplicate GPU"
        ([("n1", ["0", "1"]), ("n1", ["1"])], False),  # a pipelined prefill shares GPU 1
        ([("local", []), ("local", [])], False),  # local mode: one process, one cuda:0
    ],
)
def test_auto_transport_is_not_collective_when_prefill_and_decode_share_a_gpu(
    placed: list[tuple[str, list[str]]], collective: bool
) -> None:
    pool = WorkerPool(ControllerConfig(), BucketManagerConfig())
    pool.infos = {
        role: {"device": "Device(cuda:0)", "device_type": "cuda", "node_id": node,
               "role": role, "accelerator_ids": {"GPU": ids} if ids else {}}
        for role, (node, ids) in zip(("prefill", "decode"), placed, strict=True)
    }
    assert pool._all_on_accelerators() is collective


def test_an_explicit_collective_transport_on_a_shared_gpu_is_a_clear_error() -> None:
    """NCCL would refuse the pair deep in its first transfer ("Duplicate GPU detected")."""
    pool = WorkerPool(ControllerConfig(transport="collective"), BucketManagerConfig())
    pool.infos = {
        f"{role}-0": {"device": "Device(cuda:0)", "device_type": "cuda", "node_id": "n1",
                      "role": role, "accelerator_ids": {"GPU": ["0"]}}
        for role in ("prefill", "decode")
    }
    with pytest.raises(ValueError, match=r"prefill-0 and decode-0 share n1/GPU:0 .*"
                                         r"controller.transport to 'auto' or 'ray'"):
        pool._check_chips_apart()
    pool.infos["decode-0"]["accelerator_ids"] = {"GPU": ["1"]}
    pool._check_chips_apart()  # apart: nothing to say



# -- tensor parallelism: a card per rank -----------------------------------------------------


def test_a_tensor_parallel_worker_gets_a_bundle_with_a_card_per_rank() -> None:
    from bucketserve.controller.config import PlacementConfig
    from bucketserve.controller.stage_group import RankGroupPlacement
    from bucketserve.controller.worker_pool import worker_resources

    tp2 = PlacementConfig(tensor_parallel_size=2, num_cpus=1.5, resources={"node_a": 0.5})
    hpu = RankGroupPlacement({**worker_resources(tp2, "hpu"), "max_restarts": -1}, tp2)
    assert hpu.bundles() == [{"CPU": 1.5, "node_a": 0.5, "HPU": 1.0}] * 2
    assert hpu.feasibility_options() == [
        {"num_cpus": 1.5, "resources": {"node_a": 0.5, "HPU": 1}}
    ] * 2
    gpu = RankGroupPlacement(worker_resources(tp2, "gpu"), tp2)
    assert gpu.bundles() == [{"CPU": 1.5, "GPU": 1.0, "node_a": 0.5}] * 2
    cpu4 = PlacementConfig(tensor_parallel_size=4)
    assert RankGroupPlacement(worker_resources(cpu4, "none"), cpu4).bundles() == [{"CPU": 1.0}] * 4


@pytest.fixture(scope="module")
def hpu4_probe() -> Any:
    """A Ray of four fake Gaudi cards and an actor class that reports the card it got."""
    import ray

    @ray.remote
    class Probe:
        def cards(self) -> list[str]:
            return list(ray.get_runtime_context().get_accelerator_ids().get("HPU", []))

    ray.shutdown()
    init_local(num_cpus=4, resources={"HPU": 4}, include_dashboard=False, log_to_driver=False,
               configure_logging=False)
    yield Probe
    ray.shutdown()


@pytest.mark.slow
def test_a_tp2_prefill_and_a_tp2_decode_worker_get_four_distinct_cards(hpu4_probe) -> None:
    """With four fake Gaudi cards, each worker's placement group (its actor in bundle 0,
    its other rank's actor in bundle 1, as WorkerPool starts them) holds two; none shared."""
    import ray
    from ray.util import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from bucketserve.controller.config import PlacementConfig
    from bucketserve.controller.stage_group import RankGroupPlacement
    from bucketserve.controller.worker_pool import worker_resources

    tp2 = PlacementConfig(tensor_parallel_size=2, num_cpus=0.5)
    probes, groups = [], []
    try:
        for _role in ("prefill", "decode"):
            pg, head, rank = RankGroupPlacement(worker_resources(tp2, "hpu"), tp2).create()
            groups.append(pg)
            probes.append(hpu4_probe.options(**head).remote())
            opts = {k: v for k, v in rank.items() if k != "placement_group"}
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1)
            probes.append(hpu4_probe.options(**opts, scheduling_strategy=strategy).remote())
        cards = ray.get([p.cards.remote() for p in probes], timeout=120)
        assert [len(c) for c in cards] == [1, 1, 1, 1]
        assert len({c[0] for c in cards}) == 4
    finally:
        for probe in probes:
            ray.kill(probe)
        for pg in groups:
            remove_placement_group(pg)


# -- tensor parallelism x pipeline stages: a card per rank of every stage --------------------


def test_a_tp2_pp2_worker_gets_its_own_bundle_and_a_card_per_rank_of_each_stage() -> None:
    from bucketserve.controller.config import PlacementConfig
    from bucketserve.controller.stage_group import StageGroupPlacement
    from bucketserve.controller.worker_pool import worker_resources
    from bucketserve.kv_worker.stage_actor import stage_bundle

    tp2_pp2 = PlacementConfig(tensor_parallel_size=2, pipeline_parallel_size=2, num_cpus=0.5)
    group = StageGroupPlacement(worker_resources(tp2_pp2, "hpu"), tp2_pp2)
    assert group.bundles() == [{"CPU": 0.5}] + [{"CPU": 0.5, "HPU": 1.0}] * 4
    assert len(group.feasibility_options()) == 5
    # stage s's actor (its head rank) and its other rank: bundles 1 + 2s and 2 + 2s
    assert [stage_bundle(s, 2) + r for s in (0, 1) for r in (0, 1)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_tp2_pp2_worker_gets_four_distinct_cards(hpu4_probe) -> None:
    """With four fake Gaudi cards, one worker of two stages of two ranks: its actor in
    bundle 0 without a card, each stage's actor and its other rank's actor (in the bundles
    the stage actor places them in) a card each; none shared."""
    import ray
    from ray.util import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from bucketserve.controller.config import PlacementConfig
    from bucketserve.controller.stage_group import StageGroupPlacement
    from bucketserve.controller.worker_pool import worker_resources
    from bucketserve.kv_worker.stage_actor import stage_bundle

    tp2_pp2 = PlacementConfig(tensor_parallel_size=2, pipeline_parallel_size=2, num_cpus=0.5)
    pg, head, stage = StageGroupPlacement(worker_resources(tp2_pp2, "hpu"), tp2_pp2).create()
    opts = {k: v for k, v in stage.items() if k != "placement_group"}
    probes = [hpu4_probe.options(**head).remote()] + [
        hpu4_probe.options(**opts, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=stage_bundle(s, 2) + r)).remote()
        for s in (0, 1) for r in (0, 1)
    ]  # fmt: skip
    try:
        cards = ray.get([p.cards.remote() for p in probes], timeout=120)
        assert cards[0] == []
        assert [len(c) for c in cards[1:]] == [1, 1, 1, 1]
        assert len({c[0] for c in cards[1:]}) == 4
    finally:
        for probe in probes:
            ray.kill(probe)
        remove_placement_group(pg)


def test_a_ray_that_misses_its_start_deadline_is_started_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray's raylet must register within 30 s, which a busy 2-core machine can miss: the
    start is tried again (up to START_ATTEMPTS), other failures are raised at once."""
    import ray

    from bucketserve.controller import local_ray

    calls: list[dict] = []
    failures = ["The current node timed out during startup."]

    def init(**options: object) -> None:
        calls.append(options)
        if failures:
            raise Exception(failures.pop())  # as Ray raises it

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    init_local(num_cpus=1)
    assert len(calls) == 2 and calls[-1] == {"address": "local", "num_cpus": 1}
    failures[:] = ["bad resources"]
    with pytest.raises(Exception, match="bad resources"):
        init_local(num_cpus=1)
    failures[:] = ["timed out"] * local_ray.START_ATTEMPTS
    with pytest.raises(Exception, match="timed out"):
        init_local(num_cpus=1)
