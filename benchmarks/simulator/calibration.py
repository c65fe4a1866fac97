"""Calibrate the cost model on this machine, all in one invocation:

1. the roofline, measured apart from the model (benchmarks/roofline.py): the streaming read
   bandwidth (512 MiB) and the float32 GEMM rate of a 2048^2 matmul through the runtime's
   `linear`. These become the CPU's `mem_bandwidth` and `peak_flops`, never fitted (fitted,
   the bandwidth trades off freely against the step overhead);
2. SmolLM2-135M (float32, the embedded default) prefill and decode steps timed with the
   real ModelRunner, medians of interleaved rounds;
3. a fit of what a datasheet cannot say about a CPU running this code: the share of the
   GEMM peak its small GEMMs reach, the attention's share, the GEMM ramp, KV traffic in and
   out of cache, and the per-step overhead (Nelder-Mead on the squared log error; the cache
   size scanned on a grid, a step function having no gradient for the simplex);
4. predicted vs measured for every point, the held-out points (not fitted) included.

Everything runs with torch on one thread and is timed in that thread's CPU time: the
machine is shared, and wall-clock medians measure the neighbours (steps several times
slower than idle, varying by the minute). One thread's CPU
time is what the step costs one core, nearly untouched by load; the calibrated "cpu" is
therefore one core of this machine. Wall-clock medians are kept beside it in the JSON.

A decode step's time does not depend on the K/V values, so decode points run on an
unwritten pool with `num_computed_tokens` set, instead of paying for a prefill first.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
    flops_efficiency=0.7,
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
    CalibrationPoint("prefill", 16, 32),
    CalibrationPoint("prefill", 2, 256, held_out=True),
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


def _share(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _logit(v: float) -> float:
    return math.log(v / (1 - v))


# (name, from the fitted vector to the spec field, from the field back)
_PARAMS: tuple[tuple[str, Callable[[float], float], Callable[[float], float]], ...] = (
    ("flops_efficiency", _share, _logit),
    ("attn_flops_efficiency", _share, _logit),
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
    """The spec minimizing the squared log error over the points not held out; the measured
    roofline (`start.peak_flops`, `start.mem_bandwidth`) stays as it is."""
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


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on the calling thread alone, so that the thread's CPU time is the op's cost."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(CPU seconds of this thread, wall seconds) of one call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.thread_time() - cpu, time.perf_counter() - wall


def measure_roofline(rounds: int = 3) -> dict[str, float]:
    """This CPU's roofline apart from the model, as benchmarks/roofline.py measures it (a
    streaming sum and copy of 512 MiB; a 2048^2 float32 GEMM through the runtime's
    `linear`), on one thread and in CPU time; medians of `rounds`."""
    import torch

    from bucketserve.runtime.cpu.gemm import linear

    x = torch.ones(512 * MIB // 4)
    y = torch.empty_like(x)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    ops = {
        "sum": (x.sum, x.numel() * 4),
        "copy": (lambda: y.copy_(x), 2 * x.numel() * 4),  # read + write
        "gemm": (lambda: linear(a, b), 2 * 2048**3),
    }
    with one_thread():
        rates = {name: [] for name in ops}
        for fn, _ in ops.values():
            fn()
        for _ in range(rounds):
            for name, (fn, work) in ops.items():
                rates[name].append(work / timed(fn)[0])
    med = {name: statistics.median(v) for name, v in rates.items()}
    return {"read_bandwidth": max(med["sum"], med["copy"]), "gemm_flops": med["gemm"], **med}


def measure(
    points: Sequence[CalibrationPoint], rounds: int = 9, repeats: int = 1
) -> tuple[list[float], list[float]]:
    """Median CPU seconds per point (one thread) over `rounds` interleaved rounds of
    `repeats` runs, and the median wall seconds of the same runs."""
    from bucketserve.runtime.worker.model_runner import ModelRunner
    from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

    blocks = max(p.batch * -(-(p.length + 1) // BLOCK_SIZE) for p in points)
    runner = ModelRunner(
        ModelRunnerConfig(
            device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=blocks
        )
    )
    steps = [_step(runner, p) for p in points]
    with one_thread():
        for step in steps:  # warm-up: first-call allocations and oneDNN kernel selection
            step()
        samples: list[list[tuple[float, float]]] = [[] for _ in points]
        for _ in range(rounds):
            for i, step in enumerate(steps):
                samples[i].extend(timed(step) for _ in range(repeats))
    cpu = [statistics.median(c for c, _ in s) for s in samples]
    wall = [statistics.median(w for _, w in s) for s in samples]
    return cpu, wall


def _step(runner, point: CalibrationPoint) -> Callable[[], object]:
    from bucketserve.runtime.core.sampling_params import SamplingParams
    from bucketserve.runtime.core.sequence import Sequence as Seq

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


def run_calibration(points: Sequence[CalibrationPoint] = DEFAULT_POINTS, rounds: int = 9) -> dict:
    """Measure the roofline, then the steps; fit and compare. A few minutes on 2 cores."""
    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    roofline = measure_roofline()
    measured, wall = measure(points, rounds=rounds)
    base = CPU_START.with_(
        peak_flops=roofline["gemm_flops"], mem_bandwidth=roofline["read_bandwidth"]
    )
    spec = fit(points, measured, start=base)
    rows = compare(points, measured, CostModel(MODELS["smollm2-135m"], spec))
    for row, seconds in zip(rows, wall, strict=True):
        row["wall_ms"] = 1000 * seconds
    return {
        "clock": "CPU time of the one thread torch runs on (time.thread_time); wall_ms beside",
        "load_average": [load_before, os.getloadavg()[0]],
        "spec": asdict(spec),
        "roofline": roofline,
        "rounds": rounds,
        "rows": rows,
        "max_abs_error_pct": max(abs(r["error_pct"]) for r in rows),
        "max_abs_error_pct_held_out": max(abs(r["error_pct"]) for r in rows if r["held_out"]),
        "seconds": time.perf_counter() - start,
    }


def calibration_table(result: dict) -> str:
    from benchmarks.simulator.report import table

    spec = result["spec"]
    head = (
        f"measured roofline: GEMM {spec['peak_flops'] / 1e9:.0f} GFLOP/s, read "
        f"{spec['mem_bandwidth'] / 1e9:.1f} GB/s\n"
        f"fitted: GEMMs reach {spec['flops_efficiency']:.2f} of the peak (ramp M/(M+"
        f"{spec['gemm_m_half']:.0f})), attention {spec['attn_flops_efficiency']:.2f}, KV traffic "
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
    worst = (
        f"\nlargest error {result['max_abs_error_pct']:.1f} % (held out: "
        f"{result['max_abs_error_pct_held_out']:.1f} %)"
    )
    return (
        table(
            "Calibration: SmolLM2-135M fp32, ModelRunner on this CPU (one thread, CPU time, "
            f"medians of {result['rounds']} rounds)\n" + head,
            ("step", "batch", "len/ctx", "held out", "measured ms", "predicted ms", "error %"),
            rows,
        )
        + worst
    )
