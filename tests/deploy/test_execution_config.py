"""`model.execution` and the per-role override reach each worker's runner config."""

from __future__ import annotations

import pytest

from bucketserve.deploy.serve_config import ServeConfig
from bucketserve.deploy.serve_config_error import ServeConfigError


def test_execution_per_role_over_the_models():
    config = ServeConfig.from_dict(
        {"model": {"execution": "eager"}, "controller": {"decode": {"execution": "graphs"}}}
    )
    controller = config.controller
    assert controller.runner.execution == "eager"
    assert controller.prefill_runner().execution == "eager"
    assert controller.role_runner("decode").execution == "graphs"


def test_the_gaudi_config_runs_graphs():
    config = ServeConfig.load("bucketserve/deploy/serve-gaudi.yaml")
    assert config.controller.runner.execution == "graphs"


def test_a_bad_execution_names_its_key():
    with pytest.raises((ServeConfigError, ValueError), match="execution"):
        ServeConfig.from_dict({"controller": {"prefill": {"execution": "jit"}}})
