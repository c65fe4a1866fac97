"""Fixtures the runtime tests share."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator

import pytest

# Every build of the C kernels CI proves: the native one, and on x86 the AVX2 + FMA one
# (x86-64-v3), which an AVX-512 CPU runs as well, so no ISA can silently stop compiling.
KERNEL_ISAS = ("native", "x86-64-v3") if platform.machine() == "x86_64" else ("native",)
LANES = {"x86-64-v3": 8}


def use_kernels(isa: str, monkeypatch: pytest.MonkeyPatch):
    """The kernels built for `-march=isa`, loaded in place of the native build for the rest
    of the test. A build that fails here fails the test: the torch fallback is for users'
    odd machines, not a way for CI to stay green. Skipped only when switched off."""
    from bucketserve.runtime.cpu import kernels

    if os.environ.get(kernels.ENV_SWITCH) == "0":
        pytest.skip(f"{kernels.ENV_SWITCH}=0: the torch code runs")
    monkeypatch.setenv(kernels.ISA_ENV, isa)
    kernels.load.cache_clear()
    loaded = kernels.load()
    assert loaded is not None, f"the CPU kernels did not build for -march={isa} (log above)"
    assert loaded.isa == isa and loaded.lanes == LANES.get(isa, loaded.lanes)
    return loaded


@pytest.fixture(params=KERNEL_ISAS)
def kernel(request, monkeypatch) -> Iterator:
    """The C kernels of each ISA build (`KERNEL_ISAS`), asserted loaded."""
    from bucketserve.runtime.cpu import kernels

    yield use_kernels(request.param, monkeypatch)
    kernels.load.cache_clear()


@pytest.fixture(params=["onednn", "mkl", *(f"kernels-{isa}" for isa in KERNEL_ISAS)])
def gemm_backend(request, monkeypatch) -> Iterator[str]:
    """Eager CPU GEMMs through oneDNN, MKL's packed sgemm or the kernels' panel GEMM,
    whichever a machine measures fastest (`cpu_gemm_backend`, here pinned to one by
    narrowing GEMM_BACKENDS): all must give the same tokens. The kernels' GEMM runs once
    per ISA build, and so does everything else the kernels compute in that test
    (attention, norms, rotary)."""
    from bucketserve.runtime.cpu import gemm_plan, kernels, mkl_sgemm

    backend, _, isa = request.param.partition("-")
    if backend == "mkl" and not mkl_sgemm.available():
        pytest.skip("this torch build carries no MKL packed sgemm")
    if isa:
        use_kernels(isa, monkeypatch)
    monkeypatch.setattr(gemm_plan, "GEMM_BACKENDS", (backend,))
    gemm_plan.cpu_gemm_backend.cache_clear()
    yield backend
    gemm_plan.cpu_gemm_backend.cache_clear()
    kernels.load.cache_clear()


@pytest.fixture(scope="session")
def smollm_prompts(smollm_dir) -> list[list[int]]:
    """The latency demo's eight chat prompts on SmolLM2, as token ids."""
    from tests.runtime.smollm_chat import chat_prompts

    return chat_prompts(smollm_dir)


@pytest.fixture(scope="session")
def smollm_reference(smollm_dir, smollm_prompts):
    """transformers' greedy output for them, computed once for every test comparing with it."""
    from tests.runtime.smollm_chat import transformers_reference

    return transformers_reference(smollm_dir, smollm_prompts)
