"""pipeline_parallel_size per role: the YAML keys, the equal-stages rule, the placement."""

from __future__ import annotations

from pathlib import Path

import pytest

from bucketserve.controller.config import ControllerConfig, PlacementConfig
from bucketserve.controller.stage_group import StageGroupPlacement
from bucketserve.deploy.serve_config import ServeConfig, ServeConfigError


def test_the_yaml_sets_stages_per_role(tiny_model_dir: Path) -> None:
    config = ServeConfig.from_dict({
        "model": {"path": str(tiny_model_dir)},
        "controller": {
            "topology": "disaggregated",
            "prefill": {"pipeline_parallel_size": 2, "stage_packing": "STRICT_PACK"},
            "decode": {"pipeline_parallel_size": 2},
        },
    })
    c = config.controller
    assert c.prefill.pipeline_parallel_size == 2
    assert c.decode.pipeline_parallel_size == 2
    assert c.prefill.stage_packing == "STRICT_PACK"


def test_unequal_prefill_and_decode_stages_are_refused_naming_both_keys(
    tiny_model_dir: Path,
) -> None:
    data = {
        "model": {"path": str(tiny_model_dir)},
        "controller": {
            "topology": "disaggregated",
            "prefill": {"pipeline_parallel_size": 2},
            "decode": {"pipeline_parallel_size": 3},
        },
    }
    both = (
        r"controller\.prefill\.pipeline_parallel_size 2 and "
        r"controller\.decode\.pipeline_parallel_size 3 differ: each prefill stage hands"
    )
    with pytest.raises(ServeConfigError, match=both):
        ServeConfig.from_dict(data)
    with pytest.raises(ValueError, match=both):
        ControllerConfig(
            topology="disaggregated",
            prefill={"pipeline_parallel_size": 2},
            decode={"pipeline_parallel_size": 3},
        )
    # colocated runs no prefill workers: only the decode groups' stages count
    ControllerConfig(
        topology="colocated",
        prefill={"pipeline_parallel_size": 2},
        decode={"pipeline_parallel_size": 3},
    )
    with pytest.raises(ValueError, match=r"stage groups .* use 'ray'"):
        ControllerConfig(
            transport="collective",
            decode={"pipeline_parallel_size": 2},
        )
    with pytest.raises(ServeConfigError, match="stage_packing: must be one of 'PACK', 'STRICT"):
        ServeConfig.from_dict({"controller": {"prefill": {"stage_packing": "SPREAD"}}})
    with pytest.raises(ServeConfigError, match="pipeline_parallel_size: must be an integer >= 1"):
        ServeConfig.from_dict({"controller": {"decode": {"pipeline_parallel_size": 0}}})


def test_a_stage_group_is_one_placement_group_head_bundle_plus_one_card_per_stage() -> None:
    options = {
        "num_cpus": 0.5, "resources": {"HPU": 1, "node:trainium": 0.1}, "max_restarts": -1,
        "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}},
    }
    group = StageGroupPlacement(options, PlacementConfig(pipeline_parallel_size=3))
    assert group.bundles() == [
        {"CPU": 0.5, "node:trainium": 0.1},
        *[{"CPU": 0.5, "HPU": 1.0, "node:trainium": 0.1}] * 3,
    ]
    assert group.head_resources() == {"num_cpus": 0.5, "resources": {"node:trainium": 0.1}}
    gpu = StageGroupPlacement(
        {"num_cpus": 1, "num_gpus": 1}, PlacementConfig(pipeline_parallel_size=2)
    )
    assert gpu.bundles() == [{"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    assert sum(o.get("num_gpus", 0) for o in gpu.feasibility_options()) == 2
