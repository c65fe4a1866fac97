"""Ray placement of one worker's stage group (a placement group of the worker's own bundle,
its scheduler and no card, and one bundle per stage, one card each; one per rank of each
stage when stages are tensor-parallel groups) or of its tensor-parallel ranks (one bundle
per rank, one card each, the worker's actor rank 0)."""

from __future__ import annotations

import dataclasses
from typing import Any

from bucketserve.controller.config import PlacementConfig

_CARDS = ("HPU",)


@dataclasses.dataclass
class StageGroupPlacement:
    """Splits one worker's Ray options (`WorkerPool.actor_options`) into the head's and each
    stage's: the card goes to the stages, the head keeps its CPUs and custom resources.
    With `tensor_parallel_size` T each stage takes T bundles (its actor the first, its
    other ranks' RankActors the rest: `kv_worker.stage_actor.stage_bundle`)."""

    options: dict[str, Any]
    placement: PlacementConfig

    @property
    def num_stages(self) -> int:
        return self.placement.pipeline_parallel_size

    @property
    def num_cards(self) -> int:
        """Bundles with a card: one per rank of every stage."""
        return self.num_stages * self.placement.tensor_parallel_size

    def head_resources(self) -> dict[str, Any]:
        opts = self.options
        return {
            "num_cpus": opts.get("num_cpus", 1),
            "resources": {k: v for k, v in opts.get("resources", {}).items() if k not in _CARDS},
        }

    def stage_resources(self) -> dict[str, Any]:
        opts = self.options
        out: dict[str, Any] = {"num_cpus": opts.get("num_cpus", 1)}
        if opts.get("num_gpus"):
            out["num_gpus"] = opts["num_gpus"]
        if opts.get("resources"):
            out["resources"] = dict(opts["resources"])
        return out

    def feasibility_options(self) -> list[dict[str, Any]]:
        """What `_check_feasible` sums: the head plus every stage (and its ranks)."""
        return [self.head_resources()] + [self.stage_resources()] * self.num_cards

    def bundles(self) -> list[dict[str, float]]:
        return [_bundle(self.head_resources())] + [
            _bundle(self.stage_resources()) for _ in range(self.num_cards)
        ]

    def create(self) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """(placement group, the head actor's options, each stage actor's (and stage
        rank's) options)."""
        from ray.util import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = placement_group(self.bundles(), strategy=self.placement.stage_packing)
        head = {k: v for k, v in self.options.items() if k not in ("num_gpus", "resources")}
        head.update(self.head_resources())
        if not head["resources"]:
            del head["resources"]
        head["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0
        )
        stage = self.stage_resources()
        if "runtime_env" in self.options:
            stage["runtime_env"] = self.options["runtime_env"]
        stage["placement_group"] = pg
        return pg, head, stage


@dataclasses.dataclass
class RankGroupPlacement:
    """One worker's tensor-parallel ranks: `options` (`WorkerPool.actor_options`) are one
    rank's; the worker's actor (rank 0) takes bundle 0, rank r's RankActor bundle r."""

    options: dict[str, Any]
    placement: PlacementConfig

    @property
    def size(self) -> int:
        return self.placement.tensor_parallel_size

    def rank_resources(self) -> dict[str, Any]:
        return {k: v for k, v in self.options.items() if k in ("num_cpus", "num_gpus", "resources")}

    def bundles(self) -> list[dict[str, float]]:
        return [_bundle(self.rank_resources()) for _ in range(self.size)]

    def feasibility_options(self) -> list[dict[str, Any]]:
        return [self.rank_resources()] * self.size

    def create(self) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """(placement group, the worker actor's options, each other rank's options)."""
        from ray.util import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = placement_group(self.bundles(), strategy=self.placement.stage_packing)
        head = dict(self.options)
        head["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0
        )
        rank = self.rank_resources()
        if "runtime_env" in self.options:
            rank["runtime_env"] = self.options["runtime_env"]
        rank["placement_group"] = pg
        return pg, head, rank


def _bundle(resources: dict[str, Any]) -> dict[str, float]:
    bundle = {"CPU": float(resources.get("num_cpus", 0)) or 0.01}  # a bundle is never empty
    if resources.get("num_gpus"):
        bundle["GPU"] = float(resources["num_gpus"])
    bundle.update({k: float(v) for k, v in resources.get("resources", {}).items()})
    return bundle
