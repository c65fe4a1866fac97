"""The workload and its in-process reference, computed once for the disaggregated tests, and
the local Ray session of the tests with worker actors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketserve.controller.local_ray import init_local
from bucketserve.runtime.core.sampling_params import SamplingParams
from tests.disagg.helpers import mixed_workload, reference_outputs

Work = list[tuple[list[int], SamplingParams]]


@pytest.fixture(scope="session")
def work() -> Work:
    return mixed_workload()


@pytest.fixture(scope="session")
def reference(tiny_model_dir: Path, work: Work) -> list[list[int]]:
    return reference_outputs(tiny_model_dir, work)


@pytest.fixture(scope="session")
def long_work() -> Work:
    """Long generations (48 tokens, no early stop), so a fault can land mid-decode."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    return [(prompt, params) for prompt, _ in mixed_workload()]


@pytest.fixture(scope="session")
def long_reference(tiny_model_dir: Path, long_work: Work) -> list[list[int]]:
    return reference_outputs(tiny_model_dir, long_work)


@pytest.fixture(scope="package")
def _ray_session() -> Iterator[None]:
    """Ends the Ray session `ray_cards` started, after the package's tests."""
    yield
    import ray

    ray.shutdown()


@pytest.fixture
def ray_cards(_ray_session: None) -> None:
    """One local Ray session, 4 CPUs and 4 fake Gaudi cards (`resources={"HPU": 4}`), for
    the Ray tests of this package: started once, not once a module, and again after a
    module that ran a Ray of its own (test_multinode's two nodes). Tests that do not ask
    for cards place every actor on CPU."""
    import ray

    if ray.is_initialized() and ray.cluster_resources().get("HPU") == 4:
        return
    ray.shutdown()
    init_local(
        num_cpus=4,
        resources={"HPU": 4},
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
