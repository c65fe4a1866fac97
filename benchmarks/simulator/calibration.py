"""Calibrate the cost model on this machine: time SmolLM2 (float32) steps with the real
ModelRunner, fit the CPU "hardware" (GEMM FLOP/s, attention FLOP/s, GEMM ramp, KV traffic
in and out of cache, the cache size, per-step overhead) and compare predicted with measured
step times. The memory bandwidth is measured, not fitted (a streaming read of 512 MiB):
fitted, it trades off freely against the step overhead. The cache size is scanned on a
grid (a step function has no gradient for the simplex); the rest is a Nelder-Mead fit of
the squared log error.

A decode step's time does not depend on the K/V values, so decode points run on an
unwritten pool with `num_computed_tokens` set, instead of paying for a prefill first.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from benchmarks.simulator.cost_model import CostModel
from benchmarks.simulator.hardware import GB, HardwareSpec
from benchmarks.simulator.model_spec import MODELS, ModelSpec

BLOCK_SIZE = 16
MIB = 1 << 20
CACHE_GRID = tuple(range(16 * MIB, 48 * MIB + 1, 2 * MIB))
CPU_START = HardwareSpec(
    "cpu",
    peak_flops=200e9,
    mem_bandwidth=20 * GB,
    mem_bytes=24 * GB,
    flops_efficiency=1.0,
    attn_flops_efficiency=0.5,
    bw_efficiency=1.0,
    gemm_m_half=32.0,
    kv_traffic=2.0,
    kv_spill_traffic=6.0,
    cache_bytes=28 * MIB,
    dense_attention=True,
    step_overhead_s=5e-3,
    source="fitted by `python -m benchmarks.simulator calibrate` to ModelRunner on this CPU",
)


@dataclass(frozen=True)
class CalibrationPoint:
    """`prefill`: `batch` prompts of `length` tokens; `decode`: one token for `batch` rows
    holding `length` tokens of context each. Held-out points are not used by the fit."""

    kind: str
    batch: int
    length: int
    held_out: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("prefill", "decode"):
            raise ValueError(f"kind must be 'prefill' or 'decode', got {self.kind!r}")
        if self.batch < 1 or self.length < 1:
            raise ValueError(f"batch and length must be >= 1, got {self.batch}, {self.length}")

    def predict(self, cost: CostModel) -> float:
        if self.kind == "prefill":
            return cost.prefill_time([self.length] * self.batch)
        return cost.decode_time(self.batch, self.batch * self.length)


DEFAULT_POINTS = (
    CalibrationPoint("prefill", 1, 32),
    CalibrationPoint("prefill", 1, 128),
    CalibrationPoint("prefill", 1, 512),
    CalibrationPoint("prefill", 4, 128),
    CalibrationPoint("prefill", 8, 64),
    CalibrationPoint("prefill", 2, 512),
    CalibrationPoint("prefill", 16, 32),
    CalibrationPoint("prefill", 4, 256, held_out=True),
    CalibrationPoint("prefill", 1, 1024, held_out=True),
    CalibrationPoint("decode", 1, 16),
    CalibrationPoint("decode", 1, 512),
    CalibrationPoint("decode", 8, 128),
    CalibrationPoint("decode", 32, 128),
    CalibrationPoint("decode", 32, 512),
    CalibrationPoint("decode", 64, 256),
    CalibrationPoint("decode", 48, 384),
    CalibrationPoint("decode", 64, 384),
    CalibrationPoint("decode", 32, 1024),
    CalibrationPoint("decode", 16, 256, held_out=True),
    CalibrationPoint("decode", 48, 256, held_out=True),
    CalibrationPoint("decode", 40, 512, held_out=True),
)

# (name, from the fitted vector to the spec field, from the field back)
_PARAMS: tuple[tuple[str, Callable[[float], float], Callable[[float], float]], ...] = (
    ("peak_flops", math.exp, math.log),
    ("attn_flops_efficiency", lambda x: 1 / (1 + math.exp(-x)), lambda v: math.log(v / (1 - v))),
    ("gemm_m_half", math.exp, math.log),
    ("kv_traffic", lambda x: 1 + math.exp(x), lambda v: math.log(v - 1)),
    ("kv_spill_traffic", lambda x: 1 + math.exp(x), lambda v: math.log(v - 1)),
    ("step_overhead_s", math.exp, math.log),
)


def spec_from_vector(base: HardwareSpec, x: Sequence[float]) -> HardwareSpec:
    return base.with_(**{name: to(v) for (name, to, _), v in zip(_PARAMS, x, strict=True)})


def vector_from_spec(spec: HardwareSpec) -> list[float]:
    return [back(getattr(spec, name)) for name, _, back in _PARAMS]


def log_error(model: ModelSpec, spec: HardwareSpec, points, measured) -> float:
    cost = CostModel(model, spec)
    return sum(
        math.log(p.predict(cost) / m) ** 2
        for p, m in zip(points, measured, strict=True)
        if not p.held_out
    )


def fit(
    points: Sequence[CalibrationPoint],
    measured: Sequence[float],
    model: ModelSpec = MODELS["smollm2-135m"],
    start: HardwareSpec = CPU_START,
) -> HardwareSpec:
    """The spec minimizing the squared log error over the points not held out; the memory
    bandwidth stays `start.mem_bandwidth`."""
    if len(points) != len(measured) or any(m <= 0 for m in measured):
        raise ValueError("need one positive measured time per calibration point")
    if sum(not p.held_out for p in points) < len(_PARAMS):
        raise ValueError(f"the fit needs at least {len(_PARAMS)} points that are not held out")

    fits = []
    for cache in CACHE_GRID:
        base = start.with_(cache_bytes=float(cache))

        def loss(x: Sequence[float], base=base) -> float:
            try:
                return log_error(model, spec_from_vector(base, x), points, measured)
            except (OverflowError, ValueError, ZeroDivisionError):
                return math.inf

        best = vector_from_spec(base)
        for _ in range(3):  # restarts shake the simplex out of a flat corner
            best = nelder_mead(loss, best, step=0.7, iters=400)
        fits.append((loss(best), spec_from_vector(base, best)))
    return min(fits, key=lambda f: f[0])[1]


def nelder_mead(
    f: Callable[[Sequence[float]], float], x0: Sequence[float], step: float, iters: int
) -> list[float]:
    """The downhill simplex method (standard coefficients), for a handful of parameters."""
    simplex = [list(x0)] + [
        [v + (step if i == j else 0.0) for j, v in enumerate(x0)] for i in range(len(x0))
    ]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        worst = simplex[-1]
        centroid = [statistics.fmean(col) for col in zip(*simplex[:-1], strict=True)]

        def toward(t: float, worst=worst, centroid=centroid) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centroid, worst, strict=True)]

        reflected = toward(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = toward(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = toward(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [
                    [b + 0.5 * (v - b) for b, v in zip(best, x, strict=True)] for x in simplex[1:]
                ]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(len(simplex)), key=values.__getitem__)]


def compare(
    points: Sequence[CalibrationPoint], measured: Sequence[float], cost: CostModel
) -> list[dict]:
    rows = []
    for point, seconds in zip(points, measured, strict=True):
        predicted = point.predict(cost)
        rows.append(
            {
                **asdict(point),
                "measured_ms": 1000 * seconds,
                "predicted_ms": 1000 * predicted,
                "error_pct": 100 * (predicted - seconds) / seconds,
            }
        )
    return rows


def measure_bandwidth() -> float:
    """Bytes/s of a streaming read, as the dense layers stream their weights."""
    from benchmarks.roofline import read_bandwidth

    return read_bandwidth(num_bytes=512 * MIB)["best"]


def measure(points: Sequence[CalibrationPoint], rounds: int = 3, repeats: int = 2) -> list[float]:
    """Median seconds per point over `rounds` interleaved rounds of `repeats` timed runs."""
    from runtime.model_runner import ModelRunner, ModelRunnerConfig

    blocks = max(p.batch * -(-(p.length + 1) // BLOCK_SIZE) for p in points)
    runner = ModelRunner(
        ModelRunnerConfig(
            device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=blocks
        )
    )
    steps = [_step(runner, p) for p in points]
    for step in steps:  # warm-up: first-call allocations and oneDNN kernel selection
        step()
    samples: list[list[float]] = [[] for _ in points]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            for _ in range(repeats):
                start = time.perf_counter()
                step()
                samples[i].append(time.perf_counter() - start)
    return [statistics.median(s) for s in samples]


def _step(runner, point: CalibrationPoint) -> Callable[[], object]:
    from runtime.sampling_params import SamplingParams
    from runtime.sequence import Sequence as Seq

    per_seq = -(-(point.length + 1) // BLOCK_SIZE)
    seqs = []
    for i in range(point.batch):
        tokens = [(7919 * (i + 1) * (j + 3)) % 40000 + 100 for j in range(point.length + 1)]
        seq = Seq(tokens, SamplingParams(temperature=0))
        seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
        seqs.append(seq)
    if point.kind == "prefill":
        for seq in seqs:
            del seq.token_ids[-1]
            seq.num_prompt_tokens = point.length
        return lambda: runner.execute(seqs, [point.length] * point.batch)
    for seq in seqs:
        seq.num_computed_tokens = point.length  # K/V "cached"; compute the next token
    return lambda: runner.execute(seqs, [1] * point.batch)


def run_calibration(points: Sequence[CalibrationPoint] = DEFAULT_POINTS) -> dict:
    """Measure, fit and compare; a few minutes on a 2-core machine."""
    start = time.perf_counter()
    bandwidth = measure_bandwidth()
    measured = measure(points)
    spec = fit(points, measured, start=CPU_START.with_(mem_bandwidth=bandwidth))
    rows = compare(points, measured, CostModel(MODELS["smollm2-135m"], spec))
    return {
        "spec": asdict(spec),
        "measured_bandwidth": bandwidth,
        "rows": rows,
        "max_abs_error_pct": max(abs(r["error_pct"]) for r in rows),
        "seconds": time.perf_counter() - start,
    }


def calibration_table(result: dict) -> str:
    from benchmarks.simulator.report import table

    spec = result["spec"]
    head = (
        f"fitted CPU: GEMM {spec['peak_flops'] / 1e9:.0f} GFLOP/s (ramp M/(M+"
        f"{spec['gemm_m_half']:.0f})), attention {spec['attn_flops_efficiency']:.2f} of it, "
        f"measured bandwidth {spec['mem_bandwidth'] / 1e9:.1f} GB/s, KV traffic "
        f"{spec['kv_traffic']:.1f}x (x{spec['kv_spill_traffic']:.1f} past "
        f"{spec['cache_bytes'] / MIB:.0f} MiB), "
        f"step overhead {1000 * spec['step_overhead_s']:.1f} ms"
    )
    rows = [
        (
            r["kind"],
            r["batch"],
            r["length"],
            "yes" if r["held_out"] else "",
            r["measured_ms"],
            r["predicted_ms"],
            r["error_pct"],
        )
        for r in result["rows"]
    ]
    return table(
        "Calibration: SmolLM2-135M fp32, ModelRunner on this CPU (medians)\n" + head,
        ("step", "batch", "len/ctx", "held out", "measured ms", "predicted ms", "error %"),
        rows,
    )
