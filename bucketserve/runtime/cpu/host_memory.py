"""glibc malloc tuning for CPU workers.

torch's CPU allocator is plain malloc, and glibc's hands every freed block above its mmap
threshold (or at the heap's top, past its trim threshold) back to the kernel: each step
would then page-fault its activations in again. Raising the thresholds keeps them mapped
for reuse, as vLLM's CPU backend gets by preloading tcmalloc."""

from __future__ import annotations

import ctypes
import functools
import sys

from bucketserve import envs

_MALLOPT = {-3: 32 << 20, -1: 1 << 30, -2: 64 << 20}  # mmap threshold, trim threshold, top pad


@functools.cache
def keep_freed_host_memory() -> bool:
    """Have glibc's malloc keep freed activations for reuse (process-wide, once); False
    where it is not glibc on Linux, or with BUCKETSERVE_MALLOC_TUNING=0."""
    if sys.platform != "linux" or not envs.BUCKETSERVE_MALLOC_TUNING:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(option, value) == 1 for option, value in _MALLOPT.items())
