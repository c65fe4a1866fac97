"""Offline throughput: our engine (continuous batching, paged KV) vs transformers static
batching, SmolLM2-135M float32 on CPU, plus the machine's roofline.

All prompts (chat messages, half short questions, half long-answer requests,
alternating) arrive at t=0 and are generated greedily with `--max-new-tokens`.
Each system runs in its own subprocess, so peak RSS is per system:

- `static8`, `static32`: transformers `generate` over left-padded batches of
  8 / 32 prompts in order, each batch running until its longest sequence ends;
- `engine`: `runtime.LLM` with `--max-num-seqs` running sequences; its variants
  `engine_lp<K>` (top K logprobs per token), `engine_n<N>` (n = N samples of each
  prompt, sharing its KV blocks) and `engine_x<N>` (each prompt sent N times, n = 1)
  measure the sampling features' cost in the same invocation;
- `roofline`: memory read bandwidth (sum / copy of a 1 GiB tensor), float32
  GEMM rate (2048^2 torch.matmul and the runtime's linear), and a steady
  decode step at batch 32 against max(bytes / bandwidth, FLOPs / GEMM rate).

Per system: total output tok/s, average ms/token per sequence (between its
first and last token), TTFT p50/p99 from t=0, peak RSS; for static batching
the blog's wasted-steps table. Ratios are taken within each repeat, then the
median over `--repeats` is reported.

    python -m benchmarks.offline_throughput --num-prompts 64 --max-new-tokens 128 \\
        --out benchmarks/results/offline_throughput.json [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SYSTEMS = ("static8", "static32", "engine")
DECODE_BATCH = 32


def summarize(
    t0: float, wall: float, traces: list[tuple[int, float, float]], token_ids: list[list[int]]
) -> dict[str, Any]:
    """Metrics from per-sequence (num_tokens, first_token_time, last_token_time)."""
    total = sum(n for n, _, _ in traces)
    per_token = [1000 * (last - first) / (n - 1) for n, first, last in traces if n > 1]
    ttft = [1000 * (first - t0) for _, first, _ in traces]
    return {
        "wall_s": wall,
        "output_tokens": total,
        "tok_s": total / wall,
        "ms_per_token": statistics.fmean(per_token),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "token_ids": token_ids,
    }


def load_prompts(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    from benchmarks.workload import chat_prompts, encode_chats

    return encode_chats(tokenizer, chat_prompts(args.num_prompts))


def run_static_worker(args: argparse.Namespace, batch_size: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from benchmarks.static_batching import run_static
    from bucketserve.runtime.io.tokenizer import Tokenizer
    from bucketserve.runtime.loader.model_files import resolve_model
    from bucketserve.runtime.models import load_model_config

    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = load_prompts(args, tokenizer)
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = set(load_model_config(model_dir).eos_token_ids) | {tokenizer.eos_token_id}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    run_static(model, prompts[:batch_size], batch_size, 4, pad, eos)  # warm-up
    t0 = time.perf_counter()
    run = run_static(model, prompts, batch_size, args.max_new_tokens, pad, eos)
    wall = time.perf_counter() - t0
    traces = [(t.num_tokens, t.first_token, t.last_token) for t in run.traces]
    result = summarize(t0, wall, traces, run.token_ids)
    result["steps_needed"] = [t.num_tokens for t in run.traces]
    result["steps_run"] = [t.steps_run for t in run.traces]
    return result


def engine_variant(name: str) -> dict[str, int]:
    """`engine` and its variants: engine_lp<K>, engine_n<N>, engine_x<N>."""
    if name == "engine":
        return {}
    kinds = {"lp": "logprobs", "n": "n", "x": "copies"}
    suffix = name.removeprefix("engine_")
    for prefix, key in kinds.items():
        if suffix.startswith(prefix) and suffix[len(prefix):].isdigit():
            return {key: int(suffix[len(prefix):])}
    raise ValueError(f"unknown engine variant {name!r}")


def run_engine_worker(args: argparse.Namespace, variant: dict[str, int]) -> dict[str, Any]:
    from bucketserve.runtime.core.sampling_params import SamplingParams
    from bucketserve.runtime.engine.llm import LLM

    llm = LLM(args.model, dtype="float32", device="cpu", max_num_seqs=args.max_num_seqs)
    prompts = load_prompts(args, llm.tokenizer)
    prompts = [p for p in prompts for _ in range(variant.get("copies", 1))]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    engine = llm.engine
    execute, busy = engine.executor.execute, [0.0]

    def timed_execute(seqs, counts):
        start = time.perf_counter()
        try:
            return execute(seqs, counts)
        finally:
            busy[0] += time.perf_counter() - start

    engine.executor.execute = timed_execute
    steps, preemptions = engine.stats.steps, engine.stats.num_preemptions
    logprobs = variant.get("logprobs", getattr(args, "logprobs", None))
    params = SamplingParams(
        temperature=0, max_tokens=args.max_new_tokens, logprobs=logprobs, n=variant.get("n", 1)
    )
    used = [0]

    def watch_blocks(seqs, counts):
        used[0] = max(used[0], bm.num_total_blocks - bm.num_free_blocks)
        return timed_execute(seqs, counts)

    bm = engine.block_manager
    engine.executor.execute = watch_blocks
    t0_wall, t0, cpu0 = time.perf_counter(), time.monotonic(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0_wall, time.process_time() - cpu0
    traces = [
        (len(c.token_ids), o.metrics.first_token_time, o.metrics.last_token_time)
        for o in outputs
        for c in o.outputs
    ]
    result = summarize(t0, wall, traces, [c.token_ids for o in outputs for c in o.outputs])
    result["peak_kv_blocks"] = used[0]
    # CPU seconds (all threads) per output token: the cost on a machine shared with others,
    # where wall time mostly measures the neighbours
    result["cpu_ms_per_token"] = 1000 * cpu / max(1, result["output_tokens"])
    num_steps = engine.stats.steps - steps
    result.update(
        steps=num_steps,
        preemptions=engine.stats.num_preemptions - preemptions,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=engine.block_manager.num_total_blocks,
        model_ms_per_step=1000 * busy[0] / num_steps,
        overhead_ms_per_step=1000 * (wall - busy[0]) / num_steps,
    )
    return result


def run_roofline_worker(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.roofline import decode_step_vs_roofline, gemm_rate, read_bandwidth
    from bucketserve.runtime.worker.model_runner import ModelRunner
    from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

    bandwidth = read_bandwidth()
    gemm = gemm_rate()
    blocks = DECODE_BATCH * -(-(args.decode_context + 1) // 16)
    runner = ModelRunner(
        ModelRunnerConfig(
            model=args.model, dtype="float32", device="cpu", num_kv_blocks=blocks
        )
    )
    step = decode_step_vs_roofline(
        runner, DECODE_BATCH, args.decode_context, bandwidth["best"], gemm["matmul"], iters=10
    )
    # the stricter roofline: the faster of the two GEMM paths (oneDNN beats MKL on AMD)
    best_compute_ms = 1000 * step["flops"] / gemm["best"]
    strict = step["step_ms"] / max(step["memory_bound_ms"], best_compute_ms)
    return {
        "read_bandwidth_gb_s": {k: v / 1e9 for k, v in bandwidth.items()},
        "gemm_gflop_s": {k: v / 1e9 for k, v in gemm.items()},
        "decode_step": {**step, "ratio_best_gemm": strict},
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def worker(args: argparse.Namespace) -> None:
    if args.worker.startswith("engine"):
        result = run_engine_worker(args, engine_variant(args.worker))
    elif args.worker == "roofline":
        result = run_roofline_worker(args)
    else:
        result = run_static_worker(args, int(args.worker.removeprefix("static")))
    Path(args.worker_out).write_text(json.dumps(result))


def spawn(name: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "benchmarks.offline_throughput", "--worker", name]
        cmd += ["--worker-out", str(out), *forwarded(args)]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def forwarded(args: argparse.Namespace) -> list[str]:
    flags = ["--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens)]
    flags += ["--max-num-seqs", str(args.max_num_seqs)]
    flags += ["--decode-context", str(args.decode_context)]
    if getattr(args, "logprobs", None) is not None:
        flags += ["--logprobs", str(args.logprobs)]
    return flags + (["--model", args.model] if args.model else [])


def wasted_steps(result: dict[str, Any]) -> dict[str, Any]:
    needed, run = sum(result["steps_needed"]), sum(result["steps_run"])
    return {
        "steps_needed": result["steps_needed"],
        "steps_run": result["steps_run"],
        "total_needed": needed,
        "total_run": run,
        "waste_pct": 100 * (1 - needed / run),
    }


def median_of(runs: list[dict[str, Any]], *keys: str) -> float:
    values = []
    for run in runs:
        value: Any = run
        for key in keys:
            value = value[key]
        values.append(value)
    return statistics.median(values)


def report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    systems = [s for s in args.systems if s != "roofline"]
    metrics = ("tok_s", "ms_per_token", "ttft_p50_ms", "ttft_p99_ms", "peak_rss_mb", "wall_s")
    median = {s: {m: median_of(runs, s, m) for m in metrics} for s in systems}
    base = "static32" if "static32" in systems else None
    for s in systems:
        if base:
            ratios = [run[s]["tok_s"] / run[base]["tok_s"] for run in runs]
            median[s]["tok_s_vs_static32"] = statistics.median(ratios)
        if s.startswith("static") and "engine" in systems:
            same = sum(a == b for a, b in zip(runs[-1][s]["token_ids"],
                                              runs[-1]["engine"]["token_ids"], strict=True))
            median[s]["sequences_identical_to_engine"] = same
    for s in systems:
        if not s.startswith("engine"):
            continue
        for m in ("steps", "preemptions", "model_ms_per_step", "overhead_ms_per_step",
                  "peak_kv_blocks", "output_tokens", "cpu_ms_per_token"):
            median[s][m] = median_of(runs, s, m)
        if s != "engine" and "engine" in systems:
            ratios = [run[s]["tok_s"] / run["engine"]["tok_s"] for run in runs]
            median[s]["tok_s_vs_engine"] = statistics.median(ratios)
            cpu = [run[s]["cpu_ms_per_token"] / run["engine"]["cpu_ms_per_token"]
                   for run in runs]
            median[s]["cpu_per_token_vs_engine"] = statistics.median(cpu)
    out: dict[str, Any] = {"args": vars(args), "median": median}
    out["wasted_steps"] = {
        s: wasted_steps(runs[-1][s]) for s in systems if not s.startswith("engine")
    }
    if "roofline" in args.systems:
        step = {k: median_of(runs, "roofline", "decode_step", k) for k in
                runs[0]["roofline"]["decode_step"]}
        out["roofline"] = {
            "read_bandwidth_gb_s": median_of(runs, "roofline", "read_bandwidth_gb_s", "best"),
            "matmul_gflop_s": median_of(runs, "roofline", "gemm_gflop_s", "matmul"),
            "best_gemm_gflop_s": median_of(runs, "roofline", "gemm_gflop_s", "best"),
            "decode_step": step,
            "detail": runs[-1]["roofline"],
        }
    out["targets"] = targets(out)
    out["runs"] = [{s: {k: v for k, v in r.items() if k != "token_ids"} for s, r in run.items()}
                   for run in runs]
    return out


def targets(out: dict[str, Any]) -> dict[str, Any]:
    result = {}
    engine = out["median"].get("engine", {})
    if "tok_s_vs_static32" in engine:
        ratio = engine["tok_s_vs_static32"]
        result["engine_tok_s_vs_static32 >= 2.5"] = {"value": ratio, "met": ratio >= 2.5}
    if "roofline" in out:
        ratio = out["roofline"]["decode_step"]["ratio"]
        result["decode_step_32 <= 2x roofline"] = {"value": ratio, "met": ratio <= 2.0}
    return result


def print_report(out: dict[str, Any]) -> None:
    args = out["args"]
    print(f"\n{args['num_prompts']} prompts, {args['max_new_tokens']} new tokens, greedy, "
          f"SmolLM2-135M float32 on {os.cpu_count()} CPUs; medians of {args['repeats']} runs")
    header = (f"{'system':<10} {'tok/s':>8} {'ms/tok':>8} {'TTFT p50':>10} {'TTFT p99':>10} "
              f"{'peak RSS':>9} {'vs static32':>12}")
    print(header + "\n" + "-" * len(header))
    for name, m in out["median"].items():
        ratio = m.get("tok_s_vs_static32")
        print(f"{name:<10} {m['tok_s']:>8.1f} {m['ms_per_token']:>8.1f} "
              f"{m['ttft_p50_ms']:>8.0f}ms {m['ttft_p99_ms']:>8.0f}ms "
              f"{m['peak_rss_mb']:>7.0f}MB {'' if ratio is None else f'x{ratio:.2f}':>12}")
    for name, engine in out["median"].items():
        if not name.startswith("engine"):
            continue
        ratio = engine.get("tok_s_vs_engine")
        cpu = engine.get("cpu_per_token_vs_engine")
        print(f"{name}: CPU {engine['cpu_ms_per_token']:.1f} ms/token"
              + ("" if cpu is None else f" (x{cpu:.3f} of engine)") + ", "
              f"{engine['output_tokens']:.0f} tokens, {engine['steps']:.0f} steps, "
              f"{engine['preemptions']:.0f} preemptions, peak {engine['peak_kv_blocks']:.0f} "
              f"KV blocks, model {engine['model_ms_per_step']:.1f} ms + engine overhead "
              f"{engine['overhead_ms_per_step']:.2f} ms per step"
              + ("" if ratio is None else f"; tok/s x{ratio:.3f} of engine"))
    for name, w in out["wasted_steps"].items():
        print(f"\nwasted steps, {name}: {w['total_needed']} needed of {w['total_run']} run "
              f"({w['waste_pct']:.1f}% wasted)")
        print(f"  {'seq':>4} {'steps needed':>13} {'steps run':>10} {'waste%':>7}")
        for i, (need, ran) in enumerate(zip(w["steps_needed"], w["steps_run"], strict=True)):
            if i < 8:
                print(f"  {i:>4} {need:>13} {ran:>10} {100 * (1 - need / ran):>6.1f}%")
        print(f"  ... ({len(w['steps_needed'])} sequences in the JSON)")
    if "roofline" in out:
        r = out["roofline"]
        s = r["decode_step"]
        print(f"\nroofline: read bandwidth {r['read_bandwidth_gb_s']:.1f} GB/s, torch.matmul "
              f"{r['matmul_gflop_s']:.0f} GFLOP/s (runtime linear: {r['best_gemm_gflop_s']:.0f})")
        print(f"decode step at batch {s['batch']:.0f}, context {s['context']:.0f}: "
              f"{s['step_ms']:.1f} ms vs roofline {s['roofline_ms']:.1f} ms "
              f"(memory {s['memory_bound_ms']:.1f} ms, compute {s['compute_bound_ms']:.1f} ms)"
              f" -> x{s['ratio']:.2f} (x{s['ratio_best_gemm']:.2f} against the faster GEMM)")
    for name, t in out["targets"].items():
        print(f"target {name}: {t['value']:.2f} {'met' if t['met'] else 'MISSED'}")


def write_json(out: dict[str, Any], path: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {target}")


def add_workload_args(parser: argparse.ArgumentParser, repeats: int) -> None:
    """The offline workload's flags, shared by the benchmarks that replay it."""
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="engine running limit")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, repeats=1)
    parser.add_argument("--decode-context", type=int, default=128,
                        help="KV tokens per sequence in the roofline decode step")
    parser.add_argument("--systems", default=",".join((*SYSTEMS, "roofline")))
    parser.add_argument("--logprobs", type=int, help="engine: top logprobs per token (0..20)")
    parser.add_argument("--out", default="benchmarks/results/offline_throughput.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    args.systems = args.systems.split(",")
    unknown = {s for s in args.systems if not s.startswith("engine")} - {*SYSTEMS, "roofline"}
    for name in args.systems:
        if name.startswith("engine"):
            try:
                engine_variant(name)
            except ValueError as exc:
                parser.error(str(exc))
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {[*SYSTEMS, 'roofline']}")
    runs = []
    for i in range(args.repeats):
        run = {}
        for name in args.systems:  # interleaved, so drift on a shared machine hits all alike
            print(f"[repeat {i + 1}/{args.repeats}] {name} ...", flush=True)
            run[name] = spawn(name, args)
        runs.append(run)
    out = report(args, runs)
    print_report(out)
    write_json(out, args.out)


if __name__ == "__main__":
    main()
