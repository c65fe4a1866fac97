"""Decode-step latency of ModelRunner against the matmul roofline and transformers.

One decode step at batch B (default 32) with every sequence holding ~C tokens
(default 200) of context, SmolLM2-135M float32 on CPU. Reports medians over
rounds, the roofline `2 * num_params * B / GEMM FLOP/s` for three GEMM
measurements taken in the same run, and transformers' own decode step
(DynamicCache, same batch and context) as the baseline.

    python -m benchmarks.decode_step [--batch 32] [--context 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from runtime.device import linear
from runtime.model_runner import ModelRunner, ModelRunnerConfig
from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence


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
    """FLOP/s of exactly the decode step's GEMMs (every layer's weights, then the LM head)."""
    weights = [m.weight for m in runner.model.modules() if isinstance(m, torch.nn.Linear)]
    if runner.model_config.tie_word_embeddings:
        weights.append(runner.model.model.embed_tokens.weight)
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}

    def run() -> None:
        for w in weights:
            linear(inputs[w.shape[1]], w)

    flops = sum(2 * batch * w.numel() for w in weights)
    return flops / timed(run, 5)


def decode_batch(runner: ModelRunner, batch: int, context: int) -> list[Sequence]:
    """`batch` sequences with `context` tokens of KV in the pool, each one token from done."""
    blocks_per_seq = -(-(context + 1) // runner.block_size)
    seqs = []
    for i in range(batch):
        tokens = [(7919 * (i + 1) * (j + 3)) % 40000 + 100 for j in range(context)]
        seq = Sequence(tokens, SamplingParams(temperature=0))
        seq.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
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
    parser.add_argument("--out", default="benchmarks/results/decode_step.json")
    args = parser.parse_args()

    blocks = args.batch * (-(-(args.context + 1) // 16))
    runner = ModelRunner(ModelRunnerConfig(device="cpu", dtype="float32", num_kv_blocks=blocks))
    params = runner.model_config.num_params
    seqs = decode_batch(runner, args.batch, args.context)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(runner.model_dir, dtype=torch.float32).eval()
    rounds: dict[str, list[float]] = {
        k: []
        for k in ("runner_ms", "transformers_ms", "mkl_gflops", "onednn_gflops", "model_gflops")
    }
    for _ in range(args.rounds):  # interleaved, so drift on a shared machine hits all alike
        step = 1000 * timed(lambda: runner.execute(seqs, [1] * args.batch), args.steps)
        rounds["runner_ms"].append(step)
        rounds["transformers_ms"].append(
            transformers_step_ms(hf, args.batch, args.context, args.steps)
        )
        rounds["mkl_gflops"].append(square_gemm_flops(torch.matmul) / 1e9)
        rounds["onednn_gflops"].append(square_gemm_flops(lambda a, b: linear(a, b)) / 1e9)
        rounds["model_gflops"].append(model_gemm_flops(runner, args.batch) / 1e9)
    med = {k: statistics.median(v) for k, v in rounds.items()}
    step_gflop = 2 * params * args.batch / 1e9
    rows = [
        ("ModelRunner decode step", f"{med['runner_ms']:.1f} ms", ""),
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
                f"roofline via {label}",
                f"{med[key]:.0f} GFLOP/s -> {ms:.1f} ms",
                f"step = {med['runner_ms'] / ms:.2f} x roofline",
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
