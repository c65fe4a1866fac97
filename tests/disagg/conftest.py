"""The workload and its in-process reference, computed once for the disaggregated tests."""

from __future__ import annotations

from pathlib import Path

import pytest

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
