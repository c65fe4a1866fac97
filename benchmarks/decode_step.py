"""Decode-step latency of ModelRunner against the machine's roofline and transformers.

One decode step at batch B (default 32) with every sequence holding ~C tokens
(default 200) of context, SmolLM2-135M float32 on CPU. Reports medians over
rounds: the compute bound `2 * num_params * B / GEMM FLOP/s` for three GEMM
measurements, the memory bound (weights + the batch's K/V read once, at the
measured read bandwidth), the roofline (the larger of the oneDNN compute bound
and the memory bound), all taken in the same run, and transformers' own decode
step (DynamicCache, same batch and context) as the baseline. With `--prefixes`
the same step again with the rows' contexts over that many shared cached prefixes.

    python -m benchmarks.decode_step [--batch 32] [--context 200] [--rounds 5]
        [--prefixes G --shared-context 768]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.cpu.gemm import linear
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig


def timed(fn, iters: int) -> float:
    """Median seconds of one call."""
    fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def square_gemm_flops(fn, size: int = 2048) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / timed(lambda: fn(a, b), 5)


def model_gemm_flops(runner: ModelRunner, batch: int) -> float:
    """FLOP/s of exactly the decode step's GEMMs: every layer's weights, then the LM head,
    as the step reads them (packed for oneDNN or MKL where the runner packs)."""
    model = runner.model
    pairs = []  # (weight as the GEMM reads it, its plain shape)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            parts = m.packed or m.weight.chunk(1)
            shape = (m.out_features // len(parts), m.in_features)  # packed: no plain weight
            pairs += [(part, shape) for part in parts]
    head = model.lm_head.plain_weight
    pairs.append((model.lm_head.packed if model.lm_head.packed is not None else head, head.shape))
    inputs = {shape[1]: torch.randn(batch, shape[1]) for _, shape in pairs}

    def run() -> None:
        for w, shape in pairs:
            linear(inputs[shape[1]], w)

    flops = sum(2 * batch * shape[0] * shape[1] for _, shape in pairs)
    return flops / timed(run, 5)


def read_bandwidth() -> float:
    """Bytes/s of one pass reading a 512 MiB tensor (a sum: reads, no writes)."""
    big = torch.ones(128 * 1024 * 1024)
    return big.numel() * 4 / timed(lambda: big.sum(), 5)


def weight_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Every weight once, a Linear's by its shape (once packed, its plain tensor is gone)."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            total += module.in_features * module.out_features * dtype.itemsize
            total += 0 if module.bias is None else module.bias.numel() * dtype.itemsize
        else:
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total


def step_bytes(runner: ModelRunner, batch: int, context: int) -> int:
    """What a decode step must read at least: every weight once, and each row's K/V."""
    weights = weight_bytes(runner.model, runner.dtype)
    c = runner.model_config
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * (context + 1) * batch
    return weights + kv * runner.kv_cache.dtype.itemsize


def decode_batch(
    runner: ModelRunner, batch: int, context: int, first_block: int = 0,
    prefixes: int = 0, shared_context: int = 0,
) -> list[Sequence]:
    """`batch` sequences with `context` tokens of KV in the pool, each one token from done,
    their blocks from `first_block` on. With `prefixes` G, row i's first `shared_context`
    tokens (whole blocks) sit in the blocks of cached prefix i % G, as prefix caching
    leaves them (rows of one prefix interleaved with the others')."""
    bs = runner.block_size
    blocks_per_seq = -(-(context + 1) // bs)
    shared = shared_context // bs if prefixes else 0
    prefix_tables = [
        list(range(first_block + g * shared, first_block + (g + 1) * shared))
        for g in range(prefixes)
    ]
    next_block = first_block + prefixes * shared
    seqs = []
    for i in range(batch):
        tokens = [(7919 * (i + 1) * (j + 3)) % 40000 + 100 for j in range(context)]
        seq = Sequence(tokens, SamplingParams(temperature=0))
        own = blocks_per_seq - shared
        seq.block_table = (prefix_tables[i % prefixes] if prefixes else []) + list(
            range(next_block, next_block + own)
        )
        next_block += own
        seqs.append(seq)
    for start in range(0, batch, 8):  # prefill 8 sequences at a time
        chunk = seqs[start : start + 8]
        runner.execute(chunk, [context] * len(chunk))
    for seq in seqs:
        seq.num_computed_tokens = context - 1  # re-run the last position: a steady decode step
    return seqs


def transformers_step_ms(hf, batch: int, context: int, steps: int) -> float:
    """transformers' decode step (DynamicCache) after a `context`-token prefill."""
    ids = torch.randint(100, 40000, (batch, context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = hf(ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        samples = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            out = hf(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            samples.append(time.perf_counter() - start)
    return 1000 * statistics.median(samples[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefixes", type=int, default=0,
                        help="also time a batch whose rows share this many cached prefixes")
    parser.add_argument("--shared-context", type=int, default=768,
                        help="tokens of each row's context in its shared prefix (--prefixes)")
    parser.add_argument("--out", default="benchmarks/results/decode_step.json")
    args = parser.parse_args()

    blocks = args.batch * (-(-(args.context + 1) // 16))
    runner = ModelRunner(
        ModelRunnerConfig(device="cpu", dtype="float32", num_kv_blocks=2 * blocks + 1)
    )
    params = runner.model_config.num_params
    seqs = decode_batch(runner, args.batch, args.context)
    shared = (
        decode_batch(runner, args.batch, args.context, blocks, args.prefixes, args.shared_context)
        if args.prefixes
        else None
    )
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(runner.model_dir, dtype=torch.float32).eval()
    rounds: dict[str, list[float]] = {
        k: []
        for k in (
            "runner_ms", "shared_prefix_ms", "transformers_ms", "mkl_gflops", "onednn_gflops",
            "model_gflops", "read_gbps",
        )
    }
    for _ in range(args.rounds):  # interleaved, so drift on a shared machine hits all alike
        step = 1000 * timed(lambda: runner.execute(seqs, [1] * args.batch), args.steps)
        rounds["runner_ms"].append(step)
        if shared:
            rounds["shared_prefix_ms"].append(
                1000 * timed(lambda: runner.execute(shared, [1] * args.batch), args.steps)
            )
        rounds["transformers_ms"].append(
            transformers_step_ms(hf, args.batch, args.context, args.steps)
        )
        rounds["mkl_gflops"].append(square_gemm_flops(torch.matmul) / 1e9)
        rounds["onednn_gflops"].append(square_gemm_flops(lambda a, b: linear(a, b)) / 1e9)
        rounds["model_gflops"].append(model_gemm_flops(runner, args.batch) / 1e9)
        rounds["read_gbps"].append(read_bandwidth() / 1e9)
    med = {k: statistics.median(v) for k, v in rounds.items() if v}
    step_gflop = 2 * params * args.batch / 1e9
    rows = [
        ("ModelRunner decode step", f"{med['runner_ms']:.1f} ms", ""),
        *(
            [(
                f"  rows over {args.prefixes} shared prefixes of {args.shared_context}",
                f"{med['shared_prefix_ms']:.1f} ms",
                f"x{med['shared_prefix_ms'] / med['runner_ms']:.2f} of the above",
            )]
            if shared
            else []
        ),
        (
            "transformers decode step",
            f"{med['transformers_ms']:.1f} ms",
            f"x{med['transformers_ms'] / med['runner_ms']:.2f} slower",
        ),
    ]
    roofline = {}
    for key, label in (
        ("mkl_gflops", "torch.matmul 2048^2 (MKL)"),
        ("onednn_gflops", "runtime linear 2048^2 (oneDNN)"),
        ("model_gflops", f"model GEMMs at M={args.batch}"),
    ):
        ms = step_gflop / med[key] * 1000
        roofline[key] = {"gflops": med[key], "roofline_ms": ms, "ratio": med["runner_ms"] / ms}
        rows.append(
            (
                f"compute bound via {label}",
                f"{med[key]:.0f} GFLOP/s -> {ms:.1f} ms",
                f"step = {med['runner_ms'] / ms:.2f} x",
            )
        )
    nbytes = step_bytes(runner, args.batch, args.context)
    memory_ms = nbytes / (med["read_gbps"] * 1e9) * 1000
    rows.append(
        (
            "memory bound (weights + K/V once)",
            f"{nbytes / 1e6:.0f} MB at {med['read_gbps']:.1f} GB/s -> {memory_ms:.1f} ms",
            f"step = {med['runner_ms'] / memory_ms:.2f} x",
        )
    )
    roofline_ms = max(memory_ms, roofline["onednn_gflops"]["roofline_ms"])
    roofline["machine"] = {
        "roofline_ms": roofline_ms,
        "memory_ms": memory_ms,
        "step_bytes": nbytes,
        "ratio": med["runner_ms"] / roofline_ms,
    }
    rows.append(
        (
            "roofline (max of oneDNN compute, memory)",
            f"{roofline_ms:.1f} ms",
            f"step = {med['runner_ms'] / roofline_ms:.2f} x roofline",
        )
    )
    print(
        f"batch {args.batch}, context {args.context}, {params / 1e6:.1f}M params, "
        f"{step_gflop:.2f} GFLOP/step, medians of {args.rounds} rounds"
    )
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:>28}  {note}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "args": vars(args),
        "num_params": params,
        "rounds": rounds,
        "median": med,
        "roofline": roofline,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
