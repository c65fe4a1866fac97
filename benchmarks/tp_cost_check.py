"""The simulator's tensor-parallel cost model against one real GPU.

NCCL will not run two ranks on one GPU, so a TP 2 step cannot run on a one-card box. What
can be measured there is each side of the model's TP 2 price:

- compute: one Llama-2-13B decoder layer at full width (TP 1) and at one TP 2 rank's
  width (half the heads, half the FFN), timed per step shape (CUDA graphs on a GPU, so
  launch overhead is out, as the model's separate step overhead is), scaled to 40 layers
  plus the LM head; the model's `dense + attention` for the same steps on this card;
- all-reduce: NCCL's `all_reduce` of each step's `tokens x hidden` activations in a group
  of one (its latency floor, the model's link `latency_s`) and the model's ring price over
  NVLink 4 at TP 2, which one card cannot check;
- the model's whole-step TP 2 vs TP 1 speed-up, and the one the measured compute plus the
  modelled all-reduce give.

    python -m benchmarks.tp_cost_check --device cuda --out benchmarks/results/tp_cost_check.json

On a CPU it runs the same code at a small width (`--scale`), as a smoke test only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.simulator.cost_model import CostModel
from benchmarks.simulator.hardware import HARDWARE, LINKS
from benchmarks.simulator.model_spec import MODELS

STEPS = (("prefill", 1, 512), ("prefill", 8, 512), ("decode", 32, 1024), ("decode", 128, 1024))
LAYER_REPEATS = 8  # one graph replays the layer this many times


def build_layer(spec, tp: int, scale: int, device: str, dtype):
    """One decoder layer's weights at rank 0 of `tp` (Megatron split), random."""
    import torch

    d = spec.head_dim
    heads, kv_heads = spec.num_heads // tp // scale, spec.num_kv_heads // tp // scale
    hidden, ffn = spec.hidden // scale, spec.ffn // tp // scale

    def w(rows, cols):
        return torch.randn(rows, cols, device=device, dtype=dtype) * 0.02

    return {
        "heads": heads, "kv_heads": kv_heads, "head_dim": d, "hidden": hidden,
        "qkv": w((heads + 2 * kv_heads) * d, hidden), "o": w(hidden, heads * d),
        "gate_up": w(2 * ffn, hidden), "down": w(hidden, ffn),
        "norm": torch.ones(hidden, device=device, dtype=dtype),
    }


def layer_forward(layer: dict, x, k_cache, v_cache, causal: bool):
    """x: [rows, q, hidden]; caches [rows, kv_heads, ctx, d] (decode) or None (prefill)."""
    import torch.nn.functional as F

    rows, q, _ = x.shape
    h, kvh, d = layer["heads"], layer["kv_heads"], layer["head_dim"]
    y = F.rms_norm(x, (x.shape[-1],), layer["norm"])
    qkv = F.linear(y, layer["qkv"]).view(rows, q, h + 2 * kvh, d).transpose(1, 2)
    qh, kh, vh = qkv.split((h, kvh, kvh), dim=1)
    if k_cache is not None:  # decode: attend over the cached context (the new key is in it)
        kh, vh = k_cache, v_cache
    a = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
    x = x + F.linear(a.transpose(1, 2).reshape(rows, q, h * d), layer["o"])
    gate, up = F.linear(F.rms_norm(x, (x.shape[-1],), layer["norm"]), layer["gate_up"]).chunk(2, -1)
    return x + F.linear(F.silu(gate) * up, layer["down"])


def time_layer(layer: dict, kind: str, rows: int, length: int, device: str, dtype,
               iters: int) -> float:
    """Seconds per layer call: median over `iters` replays of LAYER_REPEATS calls."""
    import torch

    x = torch.randn(rows, length if kind == "prefill" else 1, layer["hidden"], device=device,
                    dtype=dtype)
    k = v = None
    if kind == "decode":
        shape = (rows, layer["kv_heads"], length, layer["head_dim"])
        k = torch.randn(shape, device=device, dtype=dtype)
        v = torch.randn(shape, device=device, dtype=dtype)

    def run():
        out = x
        for _ in range(LAYER_REPEATS):
            out = layer_forward(layer, out, k, v, kind == "prefill")
        return out

    cuda = device.startswith("cuda")
    with torch.inference_mode():
        for _ in range(3):
            run()
        if cuda:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            replay = graph.replay
        else:
            replay = run
        times = []
        for _ in range(iters):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                replay()
                times.append(time.perf_counter() - t0)
    return statistics.median(times) / LAYER_REPEATS


def time_lm_head(spec, tp: int, scale: int, rows: int, device: str, dtype, iters: int) -> float:
    import torch
    import torch.nn.functional as F

    w = torch.randn(spec.vocab // tp // scale, spec.hidden // scale, device=device, dtype=dtype)
    x = torch.randn(rows, spec.hidden // scale, device=device, dtype=dtype)
    with torch.inference_mode():
        for _ in range(3):
            F.linear(x, w)
        times = []
        for _ in range(iters):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            F.linear(x, w)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def nccl_floor(sizes: list[int], device: str, dtype, iters: int) -> dict:
    """NCCL (gloo on CPU) all_reduce in a group of one: the per-call latency floor."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    out = {"backend": backend}
    try:
        for n in sizes:
            t = torch.randn(n, device=device, dtype=dtype)
            for _ in range(5):
                dist.all_reduce(t)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(t)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            out[str(n)] = (time.perf_counter() - t0) / iters
    finally:
        dist.destroy_process_group()
    return out


_TWO_RANKS = """
import os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29555", rank=rank, world_size=2)
t = torch.ones(1024, device="cuda:0")
dist.all_reduce(t)
torch.cuda.synchronize()
print("rank", rank, "all_reduce ok", t[0].item())
"""


def two_ranks_one_gpu() -> str:
    """What NCCL says to two ranks on one GPU (the reason TP 2 is not measured here)."""
    env = dict(os.environ, NCCL_DEBUG="WARN")
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_RANKS, str(r)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    lines = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            p.kill()
            text = "timed out"
        lines += [ln for ln in text.splitlines() if any(
            k in ln for k in ("Duplicate", "invalid", "Error", "ok", "timed out"))][:3]
    return " | ".join(lines)


def predicted(tp: int, kind: str, rows: int, length: int) -> dict:
    spec = MODELS["llama-2-13b"]
    cost = CostModel(spec, HARDWARE["h200"], tp, LINKS["nvlink4"] if tp > 1 else None)
    work = (cost.prefill_work([length] * rows) if kind == "prefill"
            else cost.decode_work(rows, rows * length))
    parts = cost.breakdown(work)
    return {"compute_s": parts["dense"] + parts["attention"], "allreduce_s": parts["allreduce"],
            "step_s": sum(parts.values()), "overhead_s": parts["overhead"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--scale", type=int, default=None,
                        help="divide widths by this (default 1 on cuda, 20 on cpu)")
    parser.add_argument("--out", default="benchmarks/results/tp_cost_check.json")
    args = parser.parse_args()
    import torch

    dtype = getattr(torch, args.dtype)
    scale = args.scale or (1 if args.device.startswith("cuda") else 20)
    spec = MODELS["llama-2-13b"]
    torch.manual_seed(0)
    rows_out = []
    sizes = []
    for kind, rows, length in STEPS:
        tokens = rows * (length if kind == "prefill" else 1)
        sizes.append(tokens * spec.hidden // scale)
        row = {"step": f"{kind} {rows} x {length}", "tokens": tokens}
        for tp in (1, 2):
            layer = build_layer(spec, tp, scale, args.device, dtype)
            per_layer = time_layer(layer, kind, rows, length, args.device, dtype, args.iters)
            del layer
            sampled = rows  # prefill samples each prompt's last token, decode every row
            head = time_lm_head(spec, tp, scale, sampled, args.device, dtype, args.iters)
            row[f"measured_tp{tp}_s"] = spec.num_layers * per_layer + head
            row[f"model_tp{tp}"] = predicted(tp, kind, rows, length)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        rows_out.append(row)
    floor = nccl_floor(sizes, args.device, dtype, args.iters * 5)
    for row, n in zip(rows_out, sizes, strict=True):
        row["allreduce_floor_s"] = floor[str(n)]
    refusal = two_ranks_one_gpu() if args.device.startswith("cuda") else ""
    device = (torch.cuda.get_device_name(0) if args.device.startswith("cuda")
              else f"cpu (scale 1/{scale}, smoke only)")
    print(f"{device}, torch {torch.__version__}, {args.dtype}; Llama-2-13B shapes"
          f"{'' if scale == 1 else f' / {scale}'}; compute = 40 layers + LM head, CUDA graphs")
    print(f"{'step':18} {'TP1 meas':>9} {'TP1 model':>9} {'TP2 meas':>9} {'TP2 model':>9} "
          f"{'meas 1/2':>8} {'model 1/2':>9} {'AR model':>9} {'AR floor':>9} "
          f"{'speed-up meas+AR':>16} {'model':>6}")
    for r in rows_out:
        m1, m2 = r["model_tp1"], r["model_tp2"]
        ar_model = m2["allreduce_s"]
        floor_step = 2 * spec.num_layers * r["allreduce_floor_s"]
        # the whole step as the model prices it, with the measured compute in place of its own
        meas_speedup = (m1["overhead_s"] + r["measured_tp1_s"]) / (
            m2["overhead_s"] + r["measured_tp2_s"] + ar_model)
        r["measured_compute_ratio"] = r["measured_tp1_s"] / r["measured_tp2_s"]
        r["model_compute_ratio"] = m1["compute_s"] / m2["compute_s"]
        r["speedup_measured_compute_model_allreduce"] = meas_speedup
        r["speedup_model"] = m1["step_s"] / m2["step_s"]
        r["allreduce_floor_per_step_s"] = floor_step
        print(f"{r['step']:18} {r['measured_tp1_s'] * 1e3:8.2f}m {m1['compute_s'] * 1e3:8.2f}m "
              f"{r['measured_tp2_s'] * 1e3:8.2f}m {m2['compute_s'] * 1e3:8.2f}m "
              f"{r['measured_compute_ratio']:8.2f} {r['model_compute_ratio']:9.2f} "
              f"{ar_model * 1e3:8.3f}m {floor_step * 1e3:8.3f}m {meas_speedup:16.2f} "
              f"{r['speedup_model']:6.2f}")
    if refusal:
        print("two NCCL ranks on one GPU:", refusal)
    out = {"device": device, "torch": torch.__version__, "dtype": args.dtype, "scale": scale,
           "layer_repeats": LAYER_REPEATS, "iters": args.iters, "steps": rows_out,
           "nccl_group_of_one": floor, "two_ranks_one_gpu": refusal}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
