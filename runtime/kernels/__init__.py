"""CPU kernels torch lacks, in plain C, built once per machine with the system compiler
and called through ctypes (no torch headers: building takes about a second).

`paged_decode` is decode attention read through the block table. Where no C compiler
is found, or `BUCKETSERVE_CPU_KERNELS=0`, `load()` returns None and the torch path in
`runtime/attention.py` runs instead (same result, a gathered copy per step).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from runtime.default_model import CACHE_ENV

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
ENV_SWITCH = "BUCKETSERVE_CPU_KERNELS"
# -march=native: the library is built on (and cached for) the CPU that runs it.
# -ffast-math + libmvec: vector expf and reassociated sums, 1.2-1.4x (the source keeps
# every value finite). torch's libgomp is already loaded: the OpenMP runtime is shared.
FLAGS = ["-O3", "-ffast-math", "-march=native", "-fopenmp", "-shared", "-fPIC"]
LIBS = ["-lmvec"] if platform.machine() == "x86_64" else []
_FUNCTIONS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}


class PagedDecodeKernel:
    """The loaded library: `__call__` runs decode attention for one layer."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fns = {}
        for dtype, name in _FUNCTIONS.items():
            fn = getattr(library, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [
                ctypes.c_int64,
                ctypes.c_float,
                ctypes.c_int,
            ]
            self._fns[dtype] = fn

    def supports(self, dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in self._fns

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Row r's one query `q [R, heads, dim]` over its first `context_lens[r]` (int32)
        pool tokens through `block_tables [R, NB]` (int64); caches `[kv_heads, blocks,
        block_size, dim]`, contiguous."""
        q = q.contiguous()
        out = torch.empty_like(q)
        rows, heads, dim = q.shape
        kv_heads, num_blocks, block_size, _ = k_cache.shape
        status = self._fns[q.dtype](
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            rows,
            heads,
            kv_heads,
            dim,
            block_size,
            block_tables.shape[1],
            num_blocks * block_size * dim,
            scale,
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"paged_decode takes head_dim <= 256, <= 16 query heads per KV head and "
                f"block_size <= 256; got {dim}, {heads // kv_heads}, {block_size}"
            )
        return out


@cache
def load() -> PagedDecodeKernel | None:
    """The kernel library (built on first use and cached), or None where it cannot be."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        return PagedDecodeKernel(ctypes.CDLL(str(_build())))
    except OSError as exc:
        logger.warning("CPU attention kernel unavailable (%s); using the torch path", exc)
        return None


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        source + " ".join([compiler, *FLAGS, platform.machine(), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    base = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "bucketserve"
    target = Path(base) / "kernels" / f"paged_decode-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: workers starting at once never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        built = subprocess.run(
            [compiler, *FLAGS, "-o", tmp, str(SOURCE), *LIBS], capture_output=True, text=True
        )
        if built.returncode != 0:
            raise OSError(f"{compiler} failed: {built.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
