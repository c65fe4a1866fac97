"""Fixtures the runtime tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["onednn", "mkl", "kernels"])
def gemm_backend(request, monkeypatch) -> str:
    """Eager CPU GEMMs through oneDNN, MKL's packed sgemm or the kernels' panel GEMM,
    whichever a machine measures fastest (`cpu_gemm_backend`): all must give the same
    tokens."""
    from runtime import device, kernels, mkl_sgemm

    if request.param == "mkl" and not mkl_sgemm.available():
        pytest.skip("this torch build carries no MKL packed sgemm")
    if request.param == "kernels" and kernels.load() is None:
        pytest.skip("no C compiler: the kernels are not built")
    monkeypatch.setenv(device.GEMM_ENV, request.param)
    device.cpu_gemm_backend.cache_clear()
    yield request.param
    device.cpu_gemm_backend.cache_clear()
