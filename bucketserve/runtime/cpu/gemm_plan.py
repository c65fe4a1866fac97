"""Which packed GEMM runs a model's weights on this CPU, measured once per process, and how
the weights are packed for it: the one CPU-backend interface the layers are packed through."""

from __future__ import annotations

import functools
import logging
import statistics
import time
from dataclasses import dataclass

import psutil
import torch

from bucketserve.runtime.cpu import mkl_sgemm, onednn, panel_gemm
from bucketserve.runtime.cpu.gemm import Weight, linear, pack_graph_weight, pack_weight

logger = logging.getLogger(__name__)

# the packed GEMMs `cpu_gemm_backend` measures (a test pins one by setting this)
GEMM_BACKENDS = ("onednn", "mkl", "kernels")
# the rows the choice is measured at: a decode batch, where the backends differ most
GEMM_CHOICE_ROWS = 32
# With the panel GEMM, GEMMs of this many rows or more (prefill chunks) run on a second
# packing of the weight for MKL, which leads the panels there (`prefill_gemm_rows`).
PREFILL_GEMM_ROWS = 256


@dataclass(frozen=True)
class GemmPlan:
    """How one model's CPU GEMMs read their weights: packed by `backend` for GEMMs of about
    `batch_hint` rows; with `large_rows`, MKL's packing beside the panels for GEMMs of that
    many rows or more; with `graphs`, as tensors a compiled region takes."""

    backend: str
    batch_hint: int
    large_rows: int | None = None
    graphs: bool = False

    @classmethod
    def choose(
        cls,
        dtype: torch.dtype,
        layer_shapes: tuple[tuple[int, int], ...],
        weight_bytes: int,
        batch_hint: int,
        graphs: bool = False,
    ) -> GemmPlan:
        """The backend that measures fastest here on one layer's `[out, in]` weights
        (`cpu_gemm_backend`); `weight_bytes`: all the layers' (`prefill_gemm_rows`)."""
        backend = cpu_gemm_backend(dtype, layer_shapes, model_bytes=weight_bytes)
        return cls(backend, batch_hint, prefill_gemm_rows(backend, weight_bytes), graphs)

    def pack(self, weight: torch.Tensor, split_rows: bool = True) -> Weight:
        """`weight` packed as planned (`pack_weight`, or `pack_graph_weight` for graphs);
        `split_rows=False` keeps to one packing whatever `large_rows` says."""
        pack = pack_graph_weight if self.graphs else pack_weight
        return pack(weight, self.batch_hint, self.backend, self.large_rows if split_rows else None)


def prefill_gemm_rows(backend: str, weight_bytes: int) -> int | None:
    """`large_rows` for a model whose layers' weights take `weight_bytes`: PREFILL_GEMM_ROWS
    when the panel GEMM runs them and MKL's copy takes at most an eighth of the machine's
    memory; None (one packing) otherwise."""
    if backend != "kernels" or not mkl_sgemm.available():
        return None
    if weight_bytes > psutil.virtual_memory().total // 8:
        return None
    return PREFILL_GEMM_ROWS


def _gemm_runs(backend: str, dtype: torch.dtype, shapes: tuple[tuple[int, int], ...]) -> bool:
    """Whether `backend` packs every weight of `shapes` in `dtype` on this machine."""
    if backend == "onednn":
        return onednn.runs(torch.empty(0, dtype=dtype))
    if backend not in ("mkl", "kernels"):
        raise ValueError(f"unknown CPU GEMM backend {backend!r}; use onednn, mkl or kernels")
    if dtype != torch.float32:
        return False
    if backend == "mkl":
        return mkl_sgemm.available()
    return all(panel_gemm.supports(shape, dtype) for shape in shapes)


@functools.cache
def cpu_gemm_backend(
    dtype: torch.dtype,
    shapes: tuple[tuple[int, int], ...],
    rows: int = GEMM_CHOICE_ROWS,
    backends: tuple[str, ...] | None = None,
    model_bytes: int | None = None,
) -> str:
    """Which packed GEMM among `backends` (GEMM_BACKENDS) runs a CPU model's `[out, in]`
    weight `shapes` (one layer's) fastest at `rows` rows on this CPU, measured once per
    process over copies of the layer that outgrow the caches, as a model's pass reads its
    weights (no more of them than the model's layers, `model_bytes` of weights in all,
    hold: a small model's pass stays in the caches): oneDNN, MKL's packed sgemm or the
    panel GEMM of the project's kernels (both float32 only). oneDNN where none of them runs
    these weights here. Which one wins depends on the CPU's vendor and generation, hence
    the measurement."""
    backends = GEMM_BACKENDS if backends is None else backends
    candidates = [b for b in backends if _gemm_runs(b, dtype, shapes)] or ["onednn"]
    if len(candidates) == 1:
        return candidates[0]
    generator = torch.Generator().manual_seed(0)
    layer_bytes = sum(n * k for n, k in shapes) * torch.finfo(dtype).bits // 8
    measured = 64 << 20 if model_bytes is None else min(64 << 20, model_bytes)
    copies = min(8, max(1, -(-measured // layer_bytes)))
    weights = [torch.randn(shape, generator=generator) * 0.02 for shape in shapes * copies]
    inputs = {k: torch.randn(rows, k, generator=generator) for _, k in shapes}
    packed = {b: [pack_weight(w, rows, b) for w in weights] for b in candidates}
    samples: dict[str, list[float]] = {b: [] for b in candidates}
    for _ in range(6):  # rounds across the backends, so drift hits them alike
        for backend, ws in packed.items():
            start = time.perf_counter()
            for w, (_, k) in zip(ws, shapes * copies, strict=True):
                linear(inputs[k], w)
            samples[backend].append(time.perf_counter() - start)
    seconds = {b: statistics.median(s[1:]) for b, s in samples.items()}  # the first warms
    best = min(seconds, key=seconds.__getitem__)
    logger.info(
        "CPU GEMMs: %s (%s at %d rows)",
        best, ", ".join(f"{b} {1e3 * s:.2f} ms" for b, s in seconds.items()), rows,
    )  # fmt: skip
    return best
