import math

import pytest

from benchmarks.simulator.calibration import (
    CPU_START,
    DEFAULT_POINTS,
    CalibrationPoint,
    compare,
    fit,
    nelder_mead,
)
from benchmarks.simulator.cost_model import CostModel
from benchmarks.simulator.model_spec import MODELS

SMOLLM = MODELS["smollm2-135m"]


def test_nelder_mead_finds_a_quadratic_minimum():
    best = nelder_mead(lambda x: (x[0] - 3) ** 2 + 10 * (x[1] + 1) ** 2, [0.0, 0.0], 1.0, 300)
    assert best == pytest.approx([3.0, -1.0], abs=1e-3)


def test_fit_recovers_a_known_cpu_from_its_own_step_times():
    truth = CPU_START.with_(
        peak_flops=300e9,
        flops_efficiency=0.55,
        attn_flops_efficiency=0.3,
        gemm_m_half=20.0,
        kv_traffic=5.0,
        kv_spill_traffic=15.0,
        cache_bytes=float(30 << 20),
        step_overhead_s=0.012,
        mem_bandwidth=40e9,
    )
    measured = [p.predict(CostModel(SMOLLM, truth)) for p in DEFAULT_POINTS]
    roofline = CPU_START.with_(peak_flops=300e9, mem_bandwidth=40e9)
    fitted = fit(DEFAULT_POINTS, measured, start=roofline)
    rows = compare(DEFAULT_POINTS, measured, CostModel(SMOLLM, fitted))
    assert max(abs(r["error_pct"]) for r in rows) < 2.0  # held-out points included
    assert fitted.flops_efficiency == pytest.approx(0.55, rel=0.05)
    assert fitted.step_overhead_s == pytest.approx(0.012, rel=0.1)
    assert (fitted.peak_flops, fitted.mem_bandwidth) == (300e9, 40e9)  # measured, never fitted


def test_compare_reports_signed_percent_error():
    point = CalibrationPoint("decode", 1, 16)
    cost = CostModel(SMOLLM, CPU_START)
    predicted = point.predict(cost)
    (row,) = compare([point], [predicted / 1.25], cost)
    assert row["error_pct"] == pytest.approx(25.0)
    assert row["measured_ms"] == pytest.approx(1000 * predicted / 1.25)


def test_bad_calibration_input_is_refused():
    with pytest.raises(ValueError, match="kind must be"):
        CalibrationPoint("train", 1, 1)
    with pytest.raises(ValueError, match="must be >= 1"):
        CalibrationPoint("decode", 0, 1)
    with pytest.raises(ValueError, match="one positive measured time"):
        fit(DEFAULT_POINTS, [1.0] * (len(DEFAULT_POINTS) - 1))
    with pytest.raises(ValueError, match="at least"):
        fit(DEFAULT_POINTS[:3], [0.1] * 3)
    assert not math.isnan(CalibrationPoint("prefill", 2, 64).predict(CostModel(SMOLLM, CPU_START)))
