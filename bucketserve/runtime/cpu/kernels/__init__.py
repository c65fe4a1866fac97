"""CPU kernels torch lacks, in plain C (`cpu_kernels.c`), built with the system compiler
and called through ctypes: no torch headers to compile against.

`build.KernelBuild` builds the library once per machine, source and target ISA
(`BUCKETSERVE_CPU_ISA`, the `-march` value: `native` by default, or a level such as
`x86-64-v3`), under a file lock so workers starting together wait for one build. The
compiler's output goes to a log file beside the library, never to the console. A failed
build is recorded and not retried (later processes skip the compiler) until
`bucketserve kernels build --force`.

`load()` is None where the build failed (one warning line says why and where the log is),
or with `BUCKETSERVE_CPU_KERNELS=0`; the model then runs the torch code each kernel
replaces (same result, more passes over memory). Inside a graph being compiled the torch
code runs too: the compiler sees it.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

import torch

from bucketserve import envs
from bucketserve.runtime.cpu.kernels.build import ISA_ENV as ISA_ENV  # re-exported: the ISA switch
from bucketserve.runtime.cpu.kernels.build import KernelBuild, KernelBuildError
from bucketserve.runtime.io.quantized import BLOCK_TYPES

logger = logging.getLogger(__name__)

ENV_SWITCH = "BUCKETSERVE_CPU_KERNELS"
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "paged_decode": [_P, _I64] + [_P] * 5 + [_I] * 6 + [_I64, _F, _I, _I],
    "paged_decode_flat": [_P, _I64] + [_P] * 6 + [_I] * 6 + [_I64, _F, _I, _I],
    "paged_prefill": [_P, _I64] + [_P] * 6 + [_I] * 6 + [_I64, _F, _I, _I],
    "rope": [_P, _P, _I, _I, _I, _I64, _I],
    "rms_norm": [_P, _P, _P, _I, _I, _F, _I],
    "silu_mul": [_P, _P, _P, _I, _I, _I64, _I64, _I],
    "write_kv": [_P, _P, _I64, _I64, _P, _P, _P, _I, _I, _I, _I64, _I],
}
_FLOAT32_ONLY = {
    "gemm_panels": [_P, _P, _P, _I, _I, _I, _I, _I],
    "block_gemm": [_P, _P, _P, _I64, _I, _I, _I, _I, _I, _I],
    "block_rows": [_P, _P, _P, _I, _I, _I, _I],
}

GEMM_PANEL = 32  # output columns per panel of a packed weight (cpu_kernels.c: PANEL)


class CpuKernels:
    """The loaded library; each method takes float32 or bfloat16 CPU tensors and runs on
    torch's thread count."""

    def __init__(self, library: ctypes.CDLL, isa: str) -> None:
        self._library = library
        self.isa = isa  # the -march value the library was built for
        self._fns = {}
        signatures = [(n, args, dtype) for n, args in _SIGNATURES.items() for dtype in _SUFFIX]
        signatures += [(name, args, torch.float32) for name, args in _FLOAT32_ONLY.items()]
        for name, argtypes, dtype in signatures:
            fn = getattr(library, f"{name}_{_SUFFIX[dtype]}")
            fn.restype, fn.argtypes = ctypes.c_int, argtypes
            self._fns[name, dtype] = fn

    def paged_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        block_starts: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Row r's one query `q [R, heads, dim]` over its first `context_lens[r]` (int32)
        pool tokens through `block_tables [R, NB]` (int64, contiguous); caches
        `[kv_heads, blocks, block_size, dim]`, contiguous. With `block_starts` (int64),
        `block_tables` is a decode step's flat block list (`attend_flat`'s layout) and row
        r's blocks start at `block_starts[r]`; a row with no context attends to nothing.
        With `sliding_window` only its last that many tokens (blocks before them unread)."""
        if block_starts is None:
            name, index = "paged_decode", (block_tables, context_lens)
        else:
            name, index = "paged_decode_flat", (block_tables, block_starts, context_lens)
        status, out = self._paged(
            name, q, k_cache, v_cache, index, q.shape[0], scale, sliding_window
        )
        _check(status, "paged_decode", q, k_cache)
        return out

    def paged_prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of a varlen step: sequence s's queries are the flat tokens
        `query_start_loc[s]:query_start_loc[s + 1]` of `q [T, heads, dim]`, its last one at
        position `context_lens[s] - 1`, over its pool tokens through `block_tables [B, NB]`
        (int64; the two others int32, all contiguous). Prompt chunks run a tiled flash
        attention, one-query rows the decode path. With `sliding_window` w the query at
        position p sees keys (p - w, p] alone; a chunk gathers only the keys its queries see."""
        index = (block_tables, query_start_loc, context_lens)
        status, out = self._paged(
            "paged_prefill", q, k_cache, v_cache, index, block_tables.shape[0], scale,
            sliding_window,
        )  # fmt: skip
        if status == -2:
            raise MemoryError("paged_prefill could not allocate its context buffers")
        _check(status, "paged_prefill", q, k_cache)
        return out

    def _paged(
        self,
        name: str,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        index: tuple[torch.Tensor, ...],
        rows: int,
        scale: float,
        sliding_window: int | None,
    ) -> tuple[int, torch.Tensor]:
        """Call an attention kernel: q (its rows may be strided, as the qkv GEMM's output
        leaves them), the caches, `index` (block tables first), out, then the shapes; its
        status and contiguous output. The kernels take no window as 0."""
        heads, dim = q.shape[1], q.shape[2]
        if q.stride(2) != 1 or q.stride(1) != dim:
            q = q.contiguous()
        out = q.new_empty(q.shape)
        kv_heads, num_blocks, block_size, _ = k_cache.shape
        status = self._fns[name, q.dtype](
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            *(t.data_ptr() for t in index),
            out.data_ptr(),
            rows,
            heads,
            kv_heads,
            dim,
            block_size,
            index[0].shape[-1],
            num_blocks * block_size * dim,
            scale,
            sliding_window or 0,
            torch.get_num_threads(),
        )
        return status, out

    @property
    def tile_unit(self) -> bool:
        """bfloat16 prompt chunks of head size a multiple of 64 run on AMX tiles: built for
        a CPU with AMX, granted by the OS, and not switched off with `BUCKETSERVE_AMX=0`."""
        return bool(self._library.amx_prefill())

    @property
    def lanes(self) -> int:
        """float32 lanes of the vectors this build computes with: 16 on AVX-512, 8 on
        AVX2, 4 on NEON."""
        return int(self._library.cpu_kernels_lanes())

    @staticmethod
    def supports(head_dim: int, num_queries_per_kv: int, block_size: int) -> bool:
        """Whether both attention kernels take these shapes."""
        return head_dim % 16 == 0 and head_dim <= 256 and num_queries_per_kv <= 16 and (
            block_size <= 256
        )

    def rope_(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of `x [T, heads, dim]` in place (rows may be strided, each row's
        heads contiguous); `cos_sin [T, 1, 2 * dim]` contiguous, x's dtype."""
        tokens, heads, dim = x.shape
        assert x.stride(2) == 1 and x.stride(1) == dim and cos_sin.is_contiguous()
        status = self._fns["rope", x.dtype](
            x.data_ptr(), cos_sin.data_ptr(), tokens, heads, dim, x.stride(0),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"rope takes head_dim <= 256; got {dim}")
        return x

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of contiguous `x [..., size]` with `weight [size]`."""
        out = torch.empty_like(x)
        size = x.shape[-1]
        self._fns["rms_norm", x.dtype](
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // size, size, eps,
            torch.get_num_threads(),
        )
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """SwiGLU's `silu(gate) * up` of `[T, size]` operands (rows may be strided, each
        row contiguous) into contiguous `out`, which may be `gate`."""
        rows, size = gate.shape
        self._fns["silu_mul", gate.dtype](
            gate.data_ptr(), up.data_ptr(), out.data_ptr(), rows, size, gate.stride(0),
            up.stride(0), torch.get_num_threads(),
        )
        return out

    def gemm_panels(
        self, x: torch.Tensor, panels: torch.Tensor, out: torch.Tensor, accumulate: bool
    ) -> torch.Tensor:
        """`out [M, N] (+)= x [M, K] . W^T` in float32, W packed as `panels [N / 32, K, 32]`
        (`bucketserve.runtime.cpu.panel_gemm.PanelGemm`); x and out contiguous. Adds to `out` when
        `accumulate`."""
        rows, k = x.shape
        self._fns["gemm_panels", torch.float32](
            x.data_ptr(), panels.data_ptr(), out.data_ptr(), rows, out.shape[1], k,
            int(accumulate), torch.get_num_threads(),
        )
        return out

    def block_gemm(
        self, x: torch.Tensor, blocks: torch.Tensor, block_type: str, out: torch.Tensor,
        accumulate: bool,
    ) -> torch.Tensor:
        """`out [M, N] (+)= x [M, K] . W^T` in float32, W `[N, K]` kept as `blocks`
        (uint8 `[N, K / block weights * block bytes]`, GGUF's layout) of `block_type`
        (`BLOCK_TYPES`); x is quantized to 8 bits per 32 values first, as llama.cpp does.
        x and blocks contiguous, out's rows contiguous (it may be a column range of a wider
        output)."""
        rows, k = x.shape
        status = self._fns["block_gemm", torch.float32](
            x.data_ptr(), blocks.data_ptr(), out.data_ptr(), out.stride(0), rows, out.shape[1], k,
            BLOCK_TYPES.index(block_type), int(accumulate), torch.get_num_threads(),
        )
        if status == -2:
            raise MemoryError("block_gemm could not allocate x's 8-bit copy")
        return out

    def block_rows(
        self, blocks: torch.Tensor, block_type: str, ids: torch.Tensor, in_features: int
    ) -> torch.Tensor:
        """Rows `ids` (int64, contiguous) of a weight kept as `blocks`, as float32
        `[len(ids), in_features]`."""
        out = torch.empty((ids.numel(), in_features))
        self._fns["block_rows", torch.float32](
            blocks.data_ptr(), ids.data_ptr(), out.data_ptr(), ids.numel(), in_features,
            BLOCK_TYPES.index(block_type), torch.get_num_threads(),
        )
        return out

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """Token t's K/V `[T, kv_heads, dim]` (rows may be strided, each row's heads
        contiguous) into pool slot `slots[t]` (int64, contiguous) of every head's plane of
        the contiguous caches `[kv_heads, ...]`; torch's `index_copy_` over that view takes
        a slow strided path (73 us a layer at batch 32)."""
        tokens, kv_heads, dim = k.shape
        self._fns["write_kv", k.dtype](
            k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr(), tokens, kv_heads, dim,
            k_cache[0].numel(), torch.get_num_threads(),
        )

    @staticmethod
    def writes(
        k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> bool:
        """Whether `write_kv` takes these tensors' layouts."""
        rows = all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
        caches = k_cache.is_contiguous() and v_cache.is_contiguous()
        return rows and caches and v.dtype == k.dtype == k_cache.dtype == v_cache.dtype


def _check(status: int, name: str, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """An attention kernel's refusal of its shapes (status -1) as an error that names them."""
    if status != 0:
        got = f"{q.shape[-1]}, {q.shape[1] // k_cache.shape[0]}, {k_cache.shape[2]}"
        raise ValueError(
            f"{name} takes head_dim a multiple of 16 up to 256, <= 16 query heads per KV head "
            f"and block_size <= 256; got {got}"
        )


def for_tensors(dtype: torch.dtype, device: torch.device) -> CpuKernels | None:
    """The kernels, where tensors of `dtype` on `device` run on them (CPU, float32 or
    bfloat16) and no graph is being compiled (the compiler traces the torch code)."""
    if torch.compiler.is_compiling() or device.type != "cpu" or dtype not in _SUFFIX:
        return None
    return load()


@cache
def load() -> CpuKernels | None:
    """The kernel library (built on first use and cached), or None where it cannot be: a
    failed build costs one warning line, not the compiler's output."""
    if not envs.BUCKETSERVE_CPU_KERNELS:
        return None
    try:
        build = KernelBuild()
        return CpuKernels(ctypes.CDLL(str(build.library())), build.isa)
    except (KernelBuildError, OSError) as exc:
        logger.warning("CPU kernels unavailable, the torch code runs: %s", exc)
        return None
