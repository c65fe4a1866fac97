"""The one place that knows about cpu / cuda / hpu: placement, dtype, memory, graphs.
The CPU's GEMMs, weight packing and malloc tuning are the CPU backend's (`runtime/cpu`)."""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable

import psutil
import torch

from bucketserve.runtime.cpu.host_memory import keep_freed_host_memory

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

GraphFn = Callable[..., torch.Tensor]
EXECUTION_MODES = ("eager", "graphs")
# how `graphs` mode compiles, per device: see Device.graph_backend
GRAPH_BACKENDS = ("inductor", "hpu_backend", "hpu_graphs", "cuda_graphs")
_CUDA_CAPTURE = threading.Lock()  # entering a capture syncs the device: one at a time


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
        (`native_bf16`): there bf16 is faster but flips greedy tokens of the SmolLM2
        parity tests at steps that are no near-tie, so it stays opt-in."""
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
