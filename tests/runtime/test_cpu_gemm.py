"""The packed CPU GEMMs (oneDNN's, MKL's, the kernels' column panels) against F.linear, at
row counts other than the one they were packed for, and the choice between them."""

from __future__ import annotations

import psutil
import pytest
import torch
import torch.nn.functional as F

from bucketserve.runtime.cpu import gemm_plan, kernels, mkl_sgemm
from bucketserve.runtime.cpu.gemm import linear, linear_add, linear_silu_mul, pack_weight
from bucketserve.runtime.cpu.gemm_plan import GemmPlan
from bucketserve.runtime.cpu.host_gemm import RowSplitGemm
from bucketserve.runtime.cpu.mkl_sgemm import PackedSgemm
from bucketserve.runtime.cpu.panel_gemm import PanelGemm

PACKED = {"mkl": PackedSgemm, "kernels": PanelGemm}


# rows: none, one, a part of one 12-row block, several, and past one 96-row block of the
# panel GEMM, with a ragged last block
@pytest.mark.parametrize("rows", [0, 1, 5, 64, 130])
def test_packed_gemms_match_f_linear(gemm_backend, rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 40, generator=g)
    other = torch.randn(rows, 96, generator=g)
    packed = pack_weight(w, 64, gemm_backend)
    assert packed is not w and isinstance(packed, PACKED.get(gemm_backend, torch.Tensor))
    ref = F.linear(x, w, b)
    torch.testing.assert_close(linear(x, packed, b), ref)
    # the residual is consumed (MKL and the panels add into it): pass a copy
    torch.testing.assert_close(linear_add(x, packed, other.clone(), b), ref + other)
    # a residual that is a strided view is read, never written
    wide_other = torch.cat([other, other], dim=1)
    before = wide_other.clone()
    strided = wide_other[:, ::2]
    torch.testing.assert_close(linear_add(x, packed, strided, b), ref + before[:, ::2])
    torch.testing.assert_close(wide_other, before)
    up = torch.randn(96, 40, generator=g)
    swiglu = F.silu(F.linear(x, w)) * F.linear(x, up)
    packed_up = pack_weight(up, 64, gemm_backend)
    torch.testing.assert_close(linear_silu_mul(x, packed, packed_up), swiglu)
    # a non-contiguous input (a column slice) reads the same rows
    wide = torch.randn(rows, 80, generator=g)
    torch.testing.assert_close(linear(wide[:, :40], packed), F.linear(wide[:, :40], w))


@pytest.mark.parametrize("rows", [1, 12, 97, 300])
def test_the_panel_gemm_blocks_rows_and_k_at_prefill_sizes(kernel, rows):
    # past 96 rows the kernel takes k in chunks of 256: k = 600 leaves a ragged last chunk;
    # 5 panels split unevenly across the threads
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(160, 600, generator=g)
    x, residual = torch.randn(rows, 600, generator=g), torch.randn(rows, 160, generator=g)
    packed = PanelGemm(w)
    want = F.linear(x, w)
    torch.testing.assert_close(packed(x), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(packed(x, accumulate=residual.clone()), want + residual,
                               atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not mkl_sgemm.available(), reason="this torch build carries no MKL sgemm")
def test_prefill_sized_gemms_run_on_the_second_packing(kernel, monkeypatch):
    """With `large_rows`, GEMMs of that many rows or more run on MKL's copy, fewer on the
    panels; both match F.linear, plain and accumulating into a residual."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 40, generator=g)
    packed = pack_weight(w, 8, "kernels", large_rows=16)
    assert isinstance(packed, RowSplitGemm)
    ran = []
    for name in ("small", "large"):
        part = getattr(packed, name)
        run = part._run
        monkeypatch.setattr(part, "_run", lambda *args, run=run, name=name: (
            ran.append(name), run(*args)))
    for rows in (1, 15, 16, 40):
        x, residual = torch.randn(rows, 40, generator=g), torch.randn(rows, 96, generator=g)
        want = F.linear(x, w)
        torch.testing.assert_close(linear(x, packed), want)
        torch.testing.assert_close(linear_add(x, packed, residual.clone()), want + residual)
    assert ran == ["small"] * 4 + ["large"] * 4


def test_the_second_packing_is_kept_only_for_the_panel_gemm_and_when_it_fits(monkeypatch):
    monkeypatch.setattr(mkl_sgemm, "available", lambda: True)
    total = psutil.virtual_memory().total
    assert gemm_plan.prefill_gemm_rows("kernels", total // 16) == gemm_plan.PREFILL_GEMM_ROWS
    assert gemm_plan.prefill_gemm_rows("kernels", total // 4) is None  # two copies won't fit
    assert gemm_plan.prefill_gemm_rows("onednn", 1 << 20) is None
    assert gemm_plan.prefill_gemm_rows("mkl", 1 << 20) is None
    monkeypatch.setattr(mkl_sgemm, "available", lambda: False)
    assert gemm_plan.prefill_gemm_rows("kernels", 1 << 20) is None


def test_a_weight_the_panel_gemm_cannot_pack_falls_back_to_onednn():
    w = torch.randn(48, 40)  # 48 output features: not whole 32-column panels
    assert not isinstance(pack_weight(w, 64, "kernels"), PanelGemm)
    x = torch.randn(3, 40)
    torch.testing.assert_close(linear(x, pack_weight(w, 64, "kernels")), F.linear(x, w))


def test_the_backend_choice():
    """Measured among GEMM_BACKENDS by default; `backends` narrows the field (one: that
    one where it runs these weights here, else oneDNN)."""
    shapes = ((64, 32), (32, 64))
    runs = {"onednn": True, "mkl": mkl_sgemm.available(), "kernels": kernels.load() is not None}
    choose = gemm_plan.cpu_gemm_backend
    choose.cache_clear()
    for choice in ("onednn", "mkl", "kernels", None, "bogus"):
        backends = None if choice is None else (choice,)
        if choice == "bogus":
            with pytest.raises(ValueError, match="unknown CPU GEMM backend 'bogus'"):
                choose(torch.float32, shapes, 8, backends)
            continue
        got = choose(torch.float32, shapes, 8, backends)
        if choice is None:
            assert got in gemm_plan.GEMM_BACKENDS and runs[got]
        else:
            assert got == (choice if runs[choice] else "onednn")
        # MKL's packed sgemm and the panel GEMM are float32 only; the panels need whole
        # 32-column panels
        assert choose(torch.bfloat16, shapes, 8, backends) == "onednn"
        if choice == "kernels":
            assert choose(torch.float32, ((48, 32),), 8, backends) != "kernels"
    choose.cache_clear()


def test_a_plan_packs_the_layers_with_mkl_beside_the_panels_and_the_head_alone(kernel):
    """`GemmPlan.pack`: the plan's backend, its `large_rows` for the layers' weights, one
    packing where `split_rows` is off (the LM head); graphs: tensors a region takes."""
    if not mkl_sgemm.available():
        pytest.skip("this torch build carries no MKL packed sgemm")
    w = torch.randn(96, 40)
    plan = GemmPlan("kernels", 8, large_rows=16)
    assert isinstance(plan.pack(w), RowSplitGemm)
    assert isinstance(plan.pack(w, split_rows=False), PanelGemm)
    graph = GemmPlan("kernels", 8, large_rows=16, graphs=True).pack(w)
    assert graph.large is not None and graph.large_rows == 16
    assert isinstance(GemmPlan("onednn", 8).pack(w), torch.Tensor)
