"""Eager vs graphs execution on one device, in one run: the offline workload's tok/s, the
decode step at batch 1/8/32, warm-up time of the default shape-bucket set, the compile time
of one graph miss and the prefill padding share.

Graphs mode compiles each shape bucket with the device's backend (`Device.graph_backend`):
inductor with static shapes on CPU, a captured CUDA graph per bucket on CUDA. The inductor
cache goes to a fresh directory, so every compile here is a cold one (a restarted worker on
the same machine finds its graphs in the cache and compiles far faster).

- offline: `runtime.LLM` over the offline workload (offline_throughput's prompts, greedy).
  In graphs mode a first pass compiles the step shapes it meets (powers of two, see
  `ModelRunner._miss_shape`); the timed pass after it compiles nothing.
- decode step: one decode step of `b` sequences with `--decode-context` tokens each,
  median of `--iters`; graphs mode at its decode bucket (b, 1, the batch's blocks).
- warm-up: the default shape buckets for `--warmup-max-model-len` (ServiceLimits' grid);
  `--warmup-sample` buckets spread over it are compiled and timed, and the total is that
  median times the bucket count (`--warmup-sample 0`: all of them, measured).
- miss: the compile seconds of a decode batch beyond every warmed bucket (2 x
  `--max-num-seqs` rows, at least 64).

    flock /tmp/bench.lock python -m benchmarks.graph_modes \\
        --out benchmarks/results/graph_modes.json

On a GPU box without the SmolLM2 weights: `--device cuda --dtype bfloat16 --model DIR
--random-weights --ignore-eos`, DIR holding config.json and the tokenizer
(`benchmarks.random_model --config-only`); benchmarks/device_check.sh does that.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

MODES = ("eager", "graphs")
DECODE_BATCHES = (1, 8, 32)


def decode_step_ms(runner, batch: int, context: int, iters: int, graphs: bool) -> float:
    from bucketserve.runtime.core.sampling_params import SamplingParams
    from bucketserve.runtime.core.sequence import Sequence

    bs = runner.block_size
    blocks = -(-(context + 1) // bs)
    seqs = []
    for i in range(batch):
        seq = Sequence([100 + (i + j) % 1000 for j in range(context + 1)], SamplingParams())
        seq.block_table = list(range(i * blocks, (i + 1) * blocks))
        seq.num_computed_tokens = context
        seqs.append(seq)
    shape = (batch, 1, batch * blocks) if graphs else None  # decode blocks: the batch's
    if graphs:
        runner.warmup([shape])
    for _ in range(3):
        runner.execute(seqs, [1] * batch, shape)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        runner.execute(seqs, [1] * batch, shape)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def offline(
    llm, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False
) -> dict[str, Any]:
    from bucketserve.runtime.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "token_ids": [o.token_ids for o in outputs]}


def warmup_set(args: argparse.Namespace, block_size: int) -> list[tuple[int, int, int]]:
    """The default buckets (prompt ones as the runner's shapes: query blocks added)."""
    from bucketserve.bucket_manager.shape_buckets import ShapeBuckets
    from bucketserve.controller.service_limits import ServiceLimits

    config = ServiceLimits.default_buckets(args.warmup_max_model_len, block_size, args.max_num_seqs)
    shapes = ShapeBuckets(config.shape_buckets, log=False)
    prompt = [(b, q, c + -(-q // block_size)) for b, q, c in shapes.prompt]
    per_seq = -(-args.warmup_max_model_len // block_size)
    return prompt + [d for d in shapes.decode if d[2] <= d[0] * per_seq]  # as DecodeWorker


def run_mode(mode: str, args: argparse.Namespace, prompts) -> dict[str, Any]:
    from bucketserve.runtime.engine.llm import LLM

    extra = {} if args.kv_memory_fraction is None else {
        "kv_memory_fraction": args.kv_memory_fraction}
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
              execution=mode, max_model_len=args.max_model_len, **extra)
    runner = llm.engine.runner
    out: dict[str, Any] = {}
    start = time.perf_counter()
    first = offline(llm, prompts, args.max_new_tokens, args.ignore_eos)
    out["first_pass_s"] = time.perf_counter() - start
    stats = runner.graph_stats
    misses0 = stats.misses if stats else 0
    runs = [offline(llm, prompts, args.max_new_tokens, args.ignore_eos)
            for _ in range(args.repeats)]
    out["tok_s"] = statistics.median(r["tok_s"] for r in runs)
    out["tok_s_runs"] = [r["tok_s"] for r in runs]
    out["same_tokens_as_first_pass"] = all(r["token_ids"] == first["token_ids"] for r in runs)
    out["token_ids"] = first["token_ids"]
    if stats:
        out["compiled_in_first_pass"] = misses0
        out["compiled_in_timed_passes"] = stats.misses - misses0
        out["first_pass_compile_s"] = stats.miss_compile_s
        out["prefill_padding_share"] = stats.prompt_padding_share
    else:
        out["prefill_padding_share"] = 0.0
    out["decode_step_ms"] = {
        b: decode_step_ms(runner, b, args.decode_context, args.iters, mode == "graphs")
        for b in DECODE_BATCHES
    }
    if mode == "graphs":
        out |= warmup_and_miss(args, runner)
    del llm, runner  # the next mode's KV pool sizes itself from the memory this frees
    gc.collect()
    if args.device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
    return out


def warmup_and_miss(args: argparse.Namespace, runner) -> dict[str, Any]:
    buckets = [s for s in warmup_set(args, runner.block_size) if s not in runner.graphs]
    chosen = buckets
    if args.warmup_sample:
        step = max(1, len(buckets) // args.warmup_sample)
        chosen = buckets[::step][: args.warmup_sample]
    seconds = runner.warmup(chosen)
    per = statistics.median(seconds.values())
    measured = args.warmup_sample == 0
    stats = runner.graph_stats
    before = stats.miss_compile_s
    misses = stats.misses
    # beyond every bucket: the default set's, the offline pass's and the decode steps' (32)
    rows = 2 * max(args.max_num_seqs, max(DECODE_BATCHES))
    decode_step_ms(runner, rows, args.decode_context, 1, graphs=False)
    assert stats.misses == misses + 1
    return {
        "warmup_buckets": len(buckets),
        "warmup_compiled": len(chosen),
        "warmup_s_per_bucket_median": per,
        "warmup_s_per_bucket_max": max(seconds.values()),
        "warmup_total_s": sum(seconds.values()) if measured else per * len(buckets),
        "warmup_total_measured": measured,
        "miss_compile_s": stats.miss_compile_s - before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per mode")
    parser.add_argument("--decode-context", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup-max-model-len", type=int, default=1024)
    parser.add_argument("--warmup-sample", type=int, default=8)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:<i> or hpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-memory-fraction", type=float, default=None)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="every request makes --max-new-tokens tokens")
    parser.add_argument("--random-weights", action="store_true",
                        help="seeded random weights shaped like --model (its config.json and "
                        "tokenizer alone are read); use with --ignore-eos")
    parser.add_argument("--out", default="benchmarks/results/graph_modes.json")
    args = parser.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", scratch_dir("inductor-"))

    from benchmarks.offline_throughput import write_json
    from benchmarks.workload import chat_prompts, encode_chats
    from bucketserve.runtime.io.tokenizer import Tokenizer
    from bucketserve.runtime.loader.model_files import resolve_model

    if args.random_weights:
        from pathlib import Path

        from benchmarks.random_model import random_model

        like = Path(args.model) if args.model else resolve_model(None)
        args.model = str(random_model(like, Path(scratch_dir("random-model-"))))
    tokenizer = Tokenizer.from_dir(resolve_model(args.model))
    prompts = encode_chats(tokenizer, chat_prompts(args.num_prompts))
    results = {mode: run_mode(mode, args, prompts) for mode in MODES}
    eager, graphs = results["eager"], results["graphs"]
    same = eager.pop("token_ids") == graphs.pop("token_ids")
    hardware = device_name(args.device)
    print(f"{hardware}, {args.dtype}, model {args.model or 'embedded SmolLM2'}"
          f"{' (random weights)' if args.random_weights else ''}")
    print_table(eager, graphs, same)
    write_json({"args": vars(args), "hardware": hardware, "same_tokens": same, **results},
               args.out)


def scratch_dir(prefix: str) -> str:
    """A temporary folder removed when the benchmark exits (a random model is 0.5 GB)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path


def device_name(device: str) -> str:
    import platform

    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()}, torch {torch.__version__}"


def print_table(eager: dict, graphs: dict, same: bool) -> None:
    rows = [("offline tok/s", eager["tok_s"], graphs["tok_s"])]
    rows += [(f"decode step b={b} ms", eager["decode_step_ms"][b], graphs["decode_step_ms"][b])
             for b in DECODE_BATCHES]
    rows.append(("prefill padding share", eager["prefill_padding_share"],
                 graphs["prefill_padding_share"]))
    print(f"{'':28} {'eager':>10} {'graphs':>10}")
    for name, a, b in rows:
        print(f"{name:28} {a:10.3f} {b:10.3f}")
    total = "measured" if graphs["warmup_total_measured"] else "extrapolated"
    print(f"graphs first pass: {graphs['first_pass_s']:.1f} s, "
          f"{graphs['compiled_in_first_pass']} shapes compiled "
          f"({graphs['first_pass_compile_s']:.1f} s); timed passes compiled "
          f"{graphs['compiled_in_timed_passes']}")
    print(f"warm-up of the default set: {graphs['warmup_buckets']} buckets, "
          f"{graphs['warmup_s_per_bucket_median']:.2f} s per bucket (median of "
          f"{graphs['warmup_compiled']}), {graphs['warmup_total_s']:.0f} s total ({total})")
    print(f"one graph miss compiled in {graphs['miss_compile_s']:.2f} s; "
          f"greedy tokens equal across modes: {same}")


if __name__ == "__main__":
    main()
