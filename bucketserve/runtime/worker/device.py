"""The one place that knows about cpu / cuda / hpu: placement, dtype, memory, graphs."""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import psutil
import torch
import torch.nn.functional as F

from bucketserve.runtime.cpu import kernels, mkl_sgemm, panel_gemm
from bucketserve.runtime.cpu.graph_ops import PanelWeight, gemm, is_panels
from bucketserve.runtime.cpu.host_gemm import HostGemm, RowSplitGemm
from bucketserve.runtime.cpu.mkl_sgemm import PackedSgemm
from bucketserve.runtime.cpu.panel_gemm import PanelGemm

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

logger = logging.getLogger(__name__)

GraphFn = Callable[..., torch.Tensor]
EXECUTION_MODES = ("eager", "graphs")
# how `graphs` mode compiles, per device: see Device.graph_backend
GRAPH_BACKENDS = ("inductor", "hpu_backend", "hpu_graphs", "cuda_graphs")
_CUDA_CAPTURE = threading.Lock()  # entering a capture syncs the device: one at a time

# oneDNN's fp32 GEMM is ~2x MKL's on the AMD CPUs we ran on (MKL picks a slow path there);
# on an Intel Xeon MKL's packed sgemm is faster at decode batches (`cpu_gemm_backend`).
# oneDNN also fuses an activation or a binary op into the GEMM's output, which saves a pass
# over the activations (and, on a busy CPU, a parallel region) per fused op.
_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_USE_ONEDNN = _ONEDNN_LINEAR is not None and torch.backends.mkldnn.is_available()
_ONEDNN_DTYPES = {torch.float32} | (
    {torch.bfloat16} if _USE_ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() else set()
)


def _onednn(x: torch.Tensor) -> bool:
    return _USE_ONEDNN and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES


# The fused oneDNN GEMMs as custom ops with fake kernels, so a compiled graph (graphs mode)
# keeps calling them (inductor's own CPU GEMM is MKL's, the slow path here) while it fuses
# the elementwise work between them.
@torch.library.custom_op("bucketserve::onednn_linear", mutates_args=())
def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, attr: str
) -> torch.Tensor:
    return _ONEDNN_LINEAR(x, weight, bias, attr, [], "")


@_onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, attr: str):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("bucketserve::onednn_linear_binary", mutates_args=())
def _onednn_binary(
    x: torch.Tensor, other: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, op: str
) -> torch.Tensor:
    return _ONEDNN_LINEAR.binary(x, other, weight, bias, op)


@_onednn_binary.register_fake
def _(x, other, weight, bias, op):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _pointwise(x, weight, bias, attr):
    if torch.compiler.is_compiling():
        return _onednn_linear(x, weight, bias, attr)
    return _ONEDNN_LINEAR(x, weight, bias, attr, [], "")


def _binary(x, other, weight, bias, op):
    if torch.compiler.is_compiling():
        return _onednn_binary(x, other, weight, bias, op)
    return _ONEDNN_LINEAR.binary(x, other, weight, bias, op)


Weight = torch.Tensor | HostGemm | PanelWeight  # what the GEMMs below take
GEMM_ENV = "BUCKETSERVE_CPU_GEMM"  # auto (measure) | onednn | mkl | kernels
GEMM_BACKENDS = ("onednn", "mkl", "kernels")
# the rows the choice is measured at: a decode batch, where the backends differ most
GEMM_CHOICE_ROWS = 32
# With the panel GEMM, GEMMs of this many rows or more (prefill chunks) run on a second
# packing of the weight for MKL, which leads the panels there (`prefill_gemm_rows`).
PREFILL_GEMM_ROWS = 256
PREFILL_GEMM_ENV = "BUCKETSERVE_PREFILL_GEMM"  # 0: the panel GEMM runs every row count


def pack_weight(
    weight: torch.Tensor, batch_hint: int, backend: str = "onednn", large_rows: int | None = None
) -> Weight:
    """`weight [out, in]` packed once for GEMMs of about `batch_hint` rows by `backend`
    (`cpu_gemm_backend`): oneDNN's blocked layout (1.1-1.7x at decode batches; the plain
    layout is re-blocked inside every call), MKL's packed sgemm or the kernels' column
    panels (float32); or `weight` itself where none runs it. Only the GEMMs below take the
    result: it is opaque to every other op. With `large_rows`, the panel GEMM's weight is
    also packed for MKL, which runs the GEMMs of at least that many rows (prefill chunks):
    at 512-2,048 rows MKL measured about 10 % faster than the panels on a 2-core Xeon."""
    if backend == "mkl" and weight.dtype == torch.float32 and weight.device.type == "cpu":
        return PackedSgemm(weight, batch_hint)
    if backend == "kernels" and panel_gemm.supports(weight.shape, weight.dtype, weight.device.type):
        if large_rows:  # prefill_gemm_rows gives it only where MKL runs
            large = PackedSgemm(weight, large_rows)
            return RowSplitGemm(PanelGemm(weight), large, large_rows)
        return PanelGemm(weight)
    if not _onednn(weight):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)


def pack_graph_weight(
    weight: torch.Tensor, batch_hint: int, backend: str, large_rows: int | None = None
) -> torch.Tensor | PanelWeight:
    """`pack_weight` for graphs mode, where a packed weight must be made of tensors (a
    compiled region's inputs): the panel GEMM's panels, with MKL's packing beside them for
    `large_rows` (`graph_ops.gemm` runs them); oneDNN's blocked layout otherwise (MKL's
    packing alone is not a weight a graph can tell from a plain one)."""
    if backend == "kernels" and panel_gemm.supports(weight.shape, weight.dtype, weight.device.type):
        large = PackedSgemm(weight, large_rows).buffer if large_rows else None
        return PanelWeight(PanelGemm(weight).panels, large, large_rows or 0)
    packed = pack_weight(weight, batch_hint)
    return packed if isinstance(packed, torch.Tensor) else weight


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through oneDNN, MKL's packed GEMM or the panel GEMM on CPU."""
    if is_panels(weight):
        out = gemm(x, weight)
        return out if bias is None else out + bias
    if isinstance(weight, HostGemm):
        out = weight(x)
        return out if bias is None else out.add_(bias)
    if _onednn(x):
        return _pointwise(x, weight, bias, "none")
    return F.linear(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, gate: Weight, up: Weight) -> torch.Tensor:
    """SwiGLU's `silu(x @ gate.T) * (x @ up.T)`: on CPU two GEMMs with the rest fused into
    them (oneDNN) or into one C pass after them (MKL, the panel GEMM)."""
    if is_panels(gate):
        return F.silu(gemm(x, gate)) * gemm(x, up)
    if isinstance(gate, HostGemm):
        g, u = gate(x), up(x)
        kernel = kernels.for_tensors(g.dtype, g.device)
        return kernel.silu_mul(g, u, g) if kernel else F.silu(g, inplace=True).mul_(u)
    if _onednn(x):
        return _binary(x, _pointwise(x, gate, None, "swish"), up, None, "mul")
    return F.silu(F.linear(x, gate)).mul_(F.linear(x, up))


def linear_add(
    x: torch.Tensor, weight: Weight, other: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ weight.T + bias + other` (a residual), one fused GEMM on CPU. `other` is
    consumed: MKL and the panel GEMM accumulate into it in place when it is contiguous
    (callers pass a residual stream they own), oneDNN fuses the add into its output."""
    if is_panels(weight):
        out = gemm(x, weight, other)
        return out if bias is None else out + bias
    if isinstance(weight, HostGemm):
        if not other.is_contiguous():
            other = other.contiguous()
        out = weight(x, accumulate=other)
        return out if bias is None else out.add_(bias)
    if _onednn(x):
        return _binary(x, other, weight, bias, "add")
    return F.linear(x, weight, bias).add_(other)


def prefill_gemm_rows(backend: str, weight_bytes: int) -> int | None:
    """`large_rows` for a model whose layers' weights take `weight_bytes`: PREFILL_GEMM_ROWS
    when the panel GEMM runs them and MKL's copy takes at most an eighth of the machine's
    memory; None (one packing) otherwise or with BUCKETSERVE_PREFILL_GEMM=0."""
    if backend != "kernels" or os.environ.get(PREFILL_GEMM_ENV, "1") == "0":
        return None
    if not mkl_sgemm.available() or weight_bytes > psutil.virtual_memory().total // 8:
        return None
    return PREFILL_GEMM_ROWS


def _gemm_runs(backend: str, dtype: torch.dtype, shapes: tuple[tuple[int, int], ...]) -> bool:
    """Whether `backend` packs every weight of `shapes` in `dtype` on this machine."""
    if backend == "onednn":
        return _onednn(torch.empty(0, dtype=dtype))
    if dtype != torch.float32:
        return False
    if backend == "mkl":
        return mkl_sgemm.available()
    return all(panel_gemm.supports(shape, dtype) for shape in shapes)


@functools.cache
def cpu_gemm_backend(
    dtype: torch.dtype, shapes: tuple[tuple[int, int], ...], rows: int = GEMM_CHOICE_ROWS
) -> str:
    """Which packed GEMM runs a CPU model's `[out, in]` weight `shapes` (one layer's)
    fastest at `rows` rows on this CPU, measured once per process over copies of the layer
    that outgrow the caches, as a model's pass reads its weights: oneDNN, MKL's packed
    sgemm or the panel GEMM of the project's kernels (both float32 only). On a 2-core
    Xeon the panel GEMM measured 1.2-1.4x MKL at 1-32 rows and MKL 1.1-1.3x oneDNN; on
    the AMD CPUs we ran MKL took half oneDNN's speed. `BUCKETSERVE_CPU_GEMM=onednn|mkl|
    kernels` skips measuring."""
    choice = os.environ.get(GEMM_ENV, "auto")
    if choice not in ("auto", *GEMM_BACKENDS):
        raise ValueError(f"{GEMM_ENV} must be auto, {', '.join(GEMM_BACKENDS)}; not {choice!r}")
    candidates = [b for b in GEMM_BACKENDS if _gemm_runs(b, dtype, shapes)] or ["onednn"]
    if choice != "auto":
        if choice in candidates:
            return choice
        logger.warning("%s=%s does not run %s weights of these shapes here; using %s",
                       GEMM_ENV, choice, dtype, candidates[0])
        return candidates[0]
    if len(candidates) == 1:
        return candidates[0]
    generator = torch.Generator().manual_seed(0)
    layer_bytes = sum(n * k for n, k in shapes) * torch.finfo(dtype).bits // 8
    copies = min(8, max(1, -(-(64 << 20) // layer_bytes)))
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
        "CPU GEMMs: %s (%s at %d rows; %s=%s picks one)",
        best, ", ".join(f"{b} {1e3 * s:.2f} ms" for b, s in seconds.items()), rows, GEMM_ENV,
        "|".join(GEMM_BACKENDS),
    )
    return best


def _habana():
    """habana_frameworks.torch, or None; imported lazily so any machine can import us."""
    try:
        return importlib.import_module("habana_frameworks.torch")
    except ImportError:
        return None


def hpu_lazy_mode(env: dict[str, str] | None = None) -> bool:
    """Whether the HPU bridge runs in lazy mode, as vllm-gaudi decides it: habana's own
    `is_lazy()` where it imports, else `PT_HPU_LAZY_MODE` (unset means eager, the default
    since Gaudi software 1.21)."""
    if env is None and _habana() is not None:
        return bool(importlib.import_module("habana_frameworks.torch.utils.internal").is_lazy())
    return (os.environ if env is None else env).get("PT_HPU_LAZY_MODE", "0") == "1"


def graph_backend_for(device_type: str, lazy: bool = False) -> str:
    """cpu: inductor; cuda: CUDA graphs; hpu: `torch.compile(backend="hpu_backend")` in
    eager mode, HPU graphs (`wrap_in_hpu_graph` + `mark_step`) in lazy mode."""
    if device_type == "hpu":
        return "hpu_graphs" if lazy else "hpu_backend"
    return "cuda_graphs" if device_type == "cuda" else "inductor"


def _raise_recompile_limits() -> None:
    """Dynamo keeps one cache entry per static shape of a code object: a compiled region
    holds one per shape bucket, more than dynamo's default limit of 8."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 4096)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 1 << 16)


# torch's CPU allocator is plain malloc, and glibc's hands every freed block above its mmap
# threshold (or at the heap's top, past its trim threshold) back to the kernel: each step
# then page-faults its activations in again (9 % of a prefill run was in the kernel; keeping
# them gave 1.15-1.25x prefill tok/s). vLLM's CPU backend preloads tcmalloc for that reason.
_MALLOPT = {-3: 32 << 20, -1: 1 << 30, -2: 64 << 20}  # mmap threshold, trim threshold, top pad
MALLOC_ENV = "BUCKETSERVE_MALLOC_TUNING"


@functools.cache
def keep_freed_host_memory() -> bool:
    """Have glibc's malloc keep freed activations for reuse (process-wide, once); False
    where it is not glibc on Linux, or with BUCKETSERVE_MALLOC_TUNING=0."""
    if sys.platform != "linux" or os.environ.get(MALLOC_ENV, "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(option, value) == 1 for option, value in _MALLOPT.items())


class Device:
    """A torch.device plus the per-backend hooks the model runner needs.

    `name` is "auto" (cuda if available, else hpu if habana imports, else cpu),
    "cpu", "cuda", "cuda:<i>" or "hpu".
    """

    def __init__(self, name: str = "auto") -> None:
        self.torch_device = self._resolve(name)
        self.type = self.torch_device.type
        self._graph_pool = None
        if self.type == "cpu":
            keep_freed_host_memory()

    def __repr__(self) -> str:
        return f"Device({self.torch_device})"

    @staticmethod
    def _resolve(name: str) -> torch.device:
        if not isinstance(name, str):
            raise ValueError(
                f"device must be a string like 'auto', 'cpu', 'cuda:0', 'hpu'; got {name!r}"
            )
        name = name.strip().lower()
        if name == "auto":
            if torch.cuda.is_available():
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("hpu") if _habana() is not None else torch.device("cpu")
        if name == "cpu":
            return torch.device("cpu")
        if name == "hpu":
            if _habana() is None:
                raise ValueError(
                    "device 'hpu' needs habana_frameworks.torch, which is not installed"
                )
            return torch.device("hpu")
        if name == "cuda" or name.startswith("cuda:"):
            if not torch.cuda.is_available():
                raise ValueError(f"device {name!r} requested but CUDA is not available; use 'cpu'")
            index = torch.cuda.current_device() if name == "cuda" else _cuda_index(name)
            return torch.device("cuda", index)
        raise ValueError(f"unknown device {name!r}; use 'auto', 'cpu', 'cuda', 'cuda:<i>' or 'hpu'")

    @property
    def default_dtype(self) -> torch.dtype:
        """bfloat16 on accelerators; float32 on CPU even where it has native bfloat16
        (`native_bf16`): there bf16 roughly doubles GEMM speed but flips greedy tokens of
        the SmolLM2 parity tests at steps that are no near-tie, so it stays opt-in."""
        return torch.float32 if self.type == "cpu" else torch.bfloat16

    @property
    def native_bf16(self) -> bool:
        """The device computes bfloat16 in hardware (on CPU: AVX-512 BF16 or AMX)."""
        if self.type != "cpu":
            return True
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()

    def resolve_dtype(self, dtype: str | torch.dtype) -> torch.dtype:
        """ "auto" gives the device default; else one of DTYPES' names."""
        if isinstance(dtype, torch.dtype):
            if dtype not in DTYPES.values():
                raise ValueError(f"unsupported dtype {dtype}; use one of {sorted(set(DTYPES))}")
            return dtype
        if dtype == "auto":
            return self.default_dtype
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use 'auto' or one of {sorted(DTYPES)}")
        return DTYPES[dtype]

    def free_memory(self) -> int:
        """Bytes that can still be allocated on this device."""
        if self.type == "cuda":  # blocks torch's caching allocator holds unused are free too
            free, _ = torch.cuda.mem_get_info(self.torch_device)
            cached = torch.cuda.memory_reserved(self.torch_device)
            return int(free + cached - torch.cuda.memory_allocated(self.torch_device))
        if self.type == "hpu":
            hpu = importlib.import_module("habana_frameworks.torch.hpu")
            stats = hpu.memory_stats()
            return int(stats["Limit"] - stats["InUse"])
        return int(psutil.virtual_memory().available)

    def synchronize(self) -> None:
        if self.type == "cuda":  # this thread's stream: a device-wide sync breaks a capture
            torch.cuda.current_stream(self.torch_device).synchronize()  # on another thread
        elif self.type == "hpu":
            importlib.import_module("habana_frameworks.torch.hpu").synchronize()

    @property
    def graph_backend(self) -> str:
        """How `graphs` mode compiles here (one of GRAPH_BACKENDS)."""
        return graph_backend_for(self.type, self.type == "hpu" and hpu_lazy_mode())

    @property
    def captures_whole_step(self) -> bool:
        """A step's graph runs whole (CUDA graphs, HPU graphs): nothing can run between its
        layers, so layer-wise KV export happens after it."""
        return self.graph_backend in ("cuda_graphs", "hpu_graphs")

    def compile(self, fn: GraphFn) -> GraphFn:
        """`fn` compiled for static shapes (one specialization per input shape): inductor on
        cpu, hpu_backend on hpu in eager mode; where a captured graph is the compiled form
        (cuda, hpu lazy) `fn` itself, captured per shape by `graph`."""
        backend = self.graph_backend
        if backend not in ("inductor", "hpu_backend"):
            return fn
        _raise_recompile_limits()
        return torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)

    def graph(self, fn: GraphFn, example_args: tuple[torch.Tensor, ...]) -> GraphFn:
        """A callable equivalent to `fn` for args shaped like `example_args`.

        cuda: a captured CUDA graph replayed on copies of the args (its output
        buffer is reused by the next replay, so consume it first); hpu in lazy
        mode: `wrap_in_hpu_graph` without its tensor cache, each call ended by a
        `mark_step`; else `fn` (already compiled by `compile`).
        """
        if self.type == "cuda":
            return self._cuda_graph(fn, example_args)
        if self.graph_backend == "hpu_graphs":
            hpu = importlib.import_module("habana_frameworks.torch.hpu")
            graph = hpu.wrap_in_hpu_graph(_FnModule(fn), disable_tensor_cache=True)

            def replay(*args: torch.Tensor) -> torch.Tensor:
                out = graph(*args)
                self.mark_step()
                return out

            return replay
        return fn

    def mark_step(self) -> None:
        """Lazy mode's graph boundary (hpu); nothing elsewhere."""
        if self.type == "hpu" and hpu_lazy_mode():
            importlib.import_module("habana_frameworks.torch.core").mark_step()

    def _cuda_graph(self, fn: GraphFn, example_args: tuple[torch.Tensor, ...]) -> GraphFn:
        with _CUDA_CAPTURE:
            return self._capture(fn, example_args)

    def _capture(self, fn: GraphFn, example_args: tuple[torch.Tensor, ...]) -> GraphFn:
        static_args = tuple(a.clone() for a in example_args)
        stream = torch.cuda.Stream(self.torch_device)
        stream.wait_stream(torch.cuda.current_stream(self.torch_device))
        with torch.cuda.stream(stream):
            fn(*static_args)  # warm-up run outside the capture, as CUDA graphs require
        torch.cuda.current_stream(self.torch_device).wait_stream(stream)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a worker sharing this process (local mode) may step on another thread
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            static_out = fn(*static_args)

        def replay(*args: torch.Tensor) -> torch.Tensor:
            for dst, src in zip(static_args, args, strict=True):
                dst.copy_(src, non_blocking=True)
            graph.replay()
            return static_out

        return replay


def _cuda_index(name: str) -> int:
    suffix = name.split(":", 1)[1]
    if not suffix.isdigit() or int(suffix) >= torch.cuda.device_count():
        raise ValueError(f"no CUDA device {name!r}; this machine has {torch.cuda.device_count()}")
    return int(suffix)


class _FnModule(torch.nn.Module):
    """Lets a plain function go through module-only graph wrappers (HPU graphs)."""

    def __init__(self, fn: GraphFn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)
