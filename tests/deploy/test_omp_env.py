"""OpenMP settings per worker: passive where pools share cores, a bounded spin alone."""

from __future__ import annotations

import pytest

from controller.config import ControllerConfig, PlacementConfig
from kv_worker.worker_env import omp_env


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)


def test_a_lone_colocated_worker_spins_as_long_as_libgomp_would() -> None:
    config = ControllerConfig(shape="colocated", num_decode=1)
    assert not config.shares_cores
    assert omp_env(2, config.shares_cores) == {
        "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "300000"
    }


@pytest.mark.parametrize(
    "config",
    [
        ControllerConfig(shape="disaggregated"),
        ControllerConfig(shape="colocated", num_decode=2),
        ControllerConfig(
            shape="colocated", decode_placement=PlacementConfig(pipeline_parallel_size=2)
        ),
    ],
)
def test_pools_sharing_cores_wait_passively(config: ControllerConfig) -> None:
    assert config.shares_cores
    assert omp_env(2, True) == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive"}


def test_pinned_roles_do_not_share() -> None:
    config = ControllerConfig(
        shape="disaggregated",
        prefill_placement=PlacementConfig(cpus=[0]),
        decode_placement=PlacementConfig(cpus=[1]),
    )
    assert not config.shares_cores


def test_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert omp_env(1, False)["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert omp_env(1, False)["GOMP_SPINCOUNT"] == "0"
