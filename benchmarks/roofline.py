"""This machine's roofline (memory read bandwidth, float32 GEMM rate) and where a decode
step of the model runner sits against it."""

from __future__ import annotations

import torch

from benchmarks.decode_step import decode_batch, timed
from bucketserve.runtime.cpu.gemm import linear
from bucketserve.runtime.worker.model_runner import ModelRunner


def read_bandwidth(num_bytes: int = 1 << 30, iters: int = 5) -> dict[str, float]:
    """Bytes/s streamed by a sum over, and a copy of, a tensor far larger than the caches."""
    x = torch.ones(num_bytes // 4)
    y = torch.empty_like(x)
    sum_bw = num_bytes / timed(x.sum, iters)
    copy_bw = 2 * num_bytes / timed(lambda: y.copy_(x), iters)  # read + write
    return {"sum": sum_bw, "copy": copy_bw, "best": max(sum_bw, copy_bw)}


def gemm_rate(
    size: int = 2048, iters: int = 5, dtype: torch.dtype = torch.float32
) -> dict[str, float]:
    """FLOP/s of a square `dtype` GEMM via torch.matmul and via the runtime's linear()."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    flops = 2 * size**3
    matmul = flops / timed(lambda: torch.matmul(a, b), iters)
    runtime_linear = flops / timed(lambda: linear(a, b), iters)
    return {"matmul": matmul, "linear": runtime_linear, "best": max(matmul, runtime_linear)}


def decode_step_vs_roofline(
    runner: ModelRunner, batch: int, context: int, bandwidth: float, flop_rate: float, iters: int
) -> dict[str, float]:
    """A steady decode step (`batch` sequences, `context` tokens of KV each) against
    max(bytes read / bandwidth, FLOPs / GEMM rate)."""
    c = runner.model_config
    seqs = decode_batch(runner, batch, context)
    step_s = timed(lambda: runner.execute(seqs, [1] * batch), iters)
    elem = torch.finfo(runner.dtype).bits // 8
    weight_bytes = c.num_params * elem
    kv_bytes = batch * context * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * elem
    attn_flops = 4 * batch * context * c.num_hidden_layers * c.num_attention_heads * c.head_dim
    flops = 2 * c.num_params * batch + attn_flops
    memory_s = (weight_bytes + kv_bytes) / bandwidth
    compute_s = flops / flop_rate
    roofline_s = max(memory_s, compute_s)
    return {
        "batch": batch,
        "context": context,
        "step_ms": 1000 * step_s,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "flops": flops,
        "memory_bound_ms": 1000 * memory_s,
        "compute_bound_ms": 1000 * compute_s,
        "roofline_ms": 1000 * roofline_s,
        "ratio": step_s / roofline_s,
    }
