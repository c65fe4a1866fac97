"""MKL's packed float32 GEMM (`cblas_sgemm_pack` / `cblas_sgemm_compute`), which torch's
x86 CPU build carries inside libtorch_cpu. A weight packed once serves GEMMs of any row
count (torch's own `_mkl_linear` uses its packing only at the one row count it was packed
for). `gemm_plan.cpu_gemm_backend` measures it against oneDNN and the panel GEMM on the
running CPU: MKL takes a slow path on some AMD CPUs, and on Intel it is the faster one at
decode batches."""

from __future__ import annotations

import ctypes
import os
from functools import cache

import torch

from bucketserve.runtime.cpu.host_gemm import HostGemm

_ROW_MAJOR, _NO_TRANS, _TRANS, _B_MATRIX, _PACKED = 101, 111, 112, 162, 151
_I, _P, _F = ctypes.c_int, ctypes.c_void_p, ctypes.c_float


@cache
def _library() -> ctypes.CDLL | None:
    """libtorch_cpu with the three cblas entry points typed, or None where it lacks them."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not torch.backends.mkl.is_available() or not os.path.exists(path):
        return None
    try:
        lib = ctypes.CDLL(path)
        size, pack, compute = (
            lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
        )
    except (OSError, AttributeError):
        return None
    size.restype, size.argtypes = ctypes.c_size_t, [_I] * 4
    pack.restype, pack.argtypes = None, [_I] * 6 + [_F, _P, _I, _P]
    compute.restype, compute.argtypes = None, [_I] * 6 + [_P, _I, _P, _I, _F, _P, _I]
    return lib


def available() -> bool:
    return _library() is not None


class PackedSgemm(HostGemm):
    """A float32 weight `[out, in]` packed once in MKL's layout (for GEMMs of about
    `batch_hint` rows; any row count runs)."""

    def __init__(self, weight: torch.Tensor, batch_hint: int) -> None:
        lib = _library()
        assert lib is not None and weight.dtype == torch.float32 and weight.dim() == 2
        self.out_features, self.in_features = weight.shape
        n, k = self.out_features, self.in_features
        weight = weight.contiguous()
        nbytes = lib.cblas_sgemm_pack_get_size(_B_MATRIX, batch_hint, n, k)
        # pages MKL leaves unwritten are never touched, so they cost no resident memory
        self.buffer = torch.empty(-(-nbytes // 4), dtype=torch.float32)
        lib.cblas_sgemm_pack(
            _ROW_MAJOR, _B_MATRIX, _TRANS, batch_hint, n, k, 1.0, weight.data_ptr(), k,
            self.buffer.data_ptr(),
        )

    def _run(self, rows: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        compute(rows, self.buffer, out, accumulate)


def compute(rows: torch.Tensor, buffer: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """`out [M, n] (+)= rows [M, k] . W^T` for W packed into `buffer` (`PackedSgemm.buffer`);
    `rows` and `out` contiguous float32."""
    (m, k), n = rows.shape, out.shape[1]
    _library().cblas_sgemm_compute(
        _ROW_MAJOR, _NO_TRANS, _PACKED, m, n, k, rows.data_ptr(), k, buffer.data_ptr(), k,
        1.0 if accumulate else 0.0, out.data_ptr(), n,
    )  # fmt: skip
