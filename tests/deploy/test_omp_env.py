"""OpenMP settings per worker: a bounded spin alone on the cores or as the one decode pool
sharing them, passive otherwise."""

from __future__ import annotations

import pytest

from bucketserve.controller.config import ControllerConfig
from bucketserve.kv_worker.worker_env import omp_env


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)


def test_a_lone_colocated_worker_spins_as_long_as_libgomp_would() -> None:
    config = ControllerConfig(topology="colocated", decode={"num_workers": 1})
    assert not config.shares_cores and config.omp_spins("decode")
    assert omp_env(2, config.omp_spins("decode")) == {
        "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "300000"
    }


def test_sharing_cores_only_the_single_decode_pool_spins() -> None:
    config = ControllerConfig(topology="disaggregated")  # 1 prefill + 1 decode, unpinned
    assert config.shares_cores
    assert config.omp_spins("decode") and not config.omp_spins("prefill")
    assert omp_env(2, config.omp_spins("prefill")) == {
        "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive"
    }


@pytest.mark.parametrize(
    "config",
    [
        ControllerConfig(topology="disaggregated", decode={"num_workers": 2}),
        ControllerConfig(topology="colocated", decode={"num_workers": 2}),
        ControllerConfig(topology="colocated", decode={"pipeline_parallel_size": 2}),
    ],
)
def test_several_decode_pools_sharing_cores_wait_passively(config: ControllerConfig) -> None:
    assert config.shares_cores
    assert not config.omp_spins("decode") and not config.omp_spins("prefill")


def test_pinned_roles_do_not_share() -> None:
    config = ControllerConfig(
        topology="disaggregated",
        prefill={"cpus": [0]},
        decode={"cpus": [1]},
    )
    assert not config.shares_cores and config.omp_spins("prefill")


def test_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert omp_env(1, False)["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert omp_env(1, False)["GOMP_SPINCOUNT"] == "0"
