"""Pipeline stages on one CPU: 1 stage x 2 threads vs 2 stages x 1 thread each.

The offline workload of `benchmarks.offline_throughput` (chat prompts, greedy, all at t=0)
through `runtime.LLM`, SmolLM2-135M float32 on the CPU, each configuration in its own
subprocess with the same intra-op thread budget (`OMP_WAIT_POLICY=passive` for both):

- `1x2`: one stage (today's engine), 2 intra-op threads;
- `2x1`: `pipeline_parallel_size=2`, stages on two threads of one process, 1 intra-op
  thread each (OpenMP team size is per thread), so the two microbatches in flight compute
  on different cores;
- `2x1-ray` (with `--ray`): the same two stages as Ray actors (the service's stage
  groups), hidden states through Ray's object store.

Per configuration: output tok/s, steps (microbatches), bubble fraction (stage time idle
while the group had work), the inter-stage hand-off per microbatch (stage s - 1 finished
it, stage s free, stage s not started yet: hidden states handed over and a thread woken),
and whether greedy tokens equal the 1-stage run's. Median over `--repeats`.

    flock /tmp/bench.lock python -m benchmarks.pipeline --num-prompts 32 --max-new-tokens 64 \\
        --out benchmarks/results/pipeline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# name: (stages, intra-op threads per stage)
CONFIGS = {"1x2": (1, 2), "2x1": (2, 1), "2x1-ray": (2, 1)}


def run_config(args: argparse.Namespace, name: str) -> dict[str, Any]:
    import torch

    from benchmarks.workload import chat_prompts, encode_chats
    from bucketserve.runtime.core.sampling_params import SamplingParams
    from bucketserve.runtime.engine.llm import LLM

    stages, threads = CONFIGS[name]
    torch.set_num_threads(threads)  # the caller's thread: the whole model when 1 stage
    if name.endswith("-ray"):
        llm = LLM(runner=ray_runner(args, stages, threads), max_num_seqs=args.max_num_seqs)
    else:
        llm = LLM(
            args.model, dtype="float32", device="cpu", max_num_seqs=args.max_num_seqs,
            pipeline_parallel_size=stages, stage_torch_threads=threads if stages > 1 else None,
        )
    prompts = encode_chats(llm.tokenizer, chat_prompts(args.num_prompts))
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    engine = llm.engine
    before = engine.runner.stats(spans=True, fresh=True) if stages > 1 else None
    steps = engine.stats.steps
    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    result: dict[str, Any] = {
        "stages": stages,
        "threads_per_stage": threads,
        "wall_s": wall,
        "output_tokens": tokens,
        "tok_s": tokens / wall,
        "steps": engine.stats.steps - steps,
        "bubble_fraction": 0.0,
        "handoff_ms_per_step": 0.0,
        "token_ids": [o.token_ids for o in outputs],
    }
    if stages > 1:
        after = engine.runner.stats(spans=True, fresh=True)
        busy = [a - b for a, b in zip(after.busy_s, before.busy_s, strict=True)]
        active = after.active_s - before.active_s
        result["bubble_fraction"] = 1.0 - sum(busy) / (stages * active)
        result["stage_busy_s"] = busy
        result["handoff_ms_per_step"] = 1000 * after.handoff_s_per_step
        result["peak_in_flight"] = engine.executor.peak_in_flight
    engine.close()
    return result


def ray_runner(args: argparse.Namespace, stages: int, threads: int):
    import ray

    from bucketserve.kv_worker.stage_group import RayStage
    from bucketserve.runtime.worker.pipeline.pipeline_runner import PipelineRunner
    from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = ModelRunnerConfig(model=args.model, dtype="float32", device="cpu")
    env = {"env_vars": {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "passive"}}
    options = {"num_cpus": 0, "runtime_env": env}
    return PipelineRunner(
        config, stages, lambda cfg, spec: RayStage(cfg, spec, options, threads, "bench")
    )


def spawn(args: argparse.Namespace, name: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "benchmarks.pipeline", "--worker", name, "--worker-out",
               str(out), "--num-prompts", str(args.num_prompts), "--max-new-tokens",
               str(args.max_new_tokens), "--max-num-seqs", str(args.max_num_seqs)]
        env_threads = str(CONFIGS[name][1] * CONFIGS[name][0])
        # idle OpenMP threads sleep: on a shared machine a spinning 2-thread team stalls
        env = {**_env(), "OMP_NUM_THREADS": env_threads, "OMP_WAIT_POLICY": "passive"}
        subprocess.run(cmd + (["--model", args.model] if args.model else []), check=True, env=env)
        return json.loads(out.read_text())


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    base = runs["1x2"][0]["token_ids"]
    out = {}
    for name, reps in runs.items():
        med = {
            key: statistics.median(r[key] for r in reps)
            for key in ("tok_s", "wall_s", "steps", "bubble_fraction", "handoff_ms_per_step")
        }
        med["tokens_equal_1_stage"] = all(r["token_ids"] == base for r in reps)
        med["repeats"] = [
            {k: v for k, v in r.items() if k != "token_ids"} for r in reps
        ]
        out[name] = med
    out["speedup_2x1_over_1x2"] = out["2x1"]["tok_s"] / out["1x2"]["tok_s"]
    if "2x1-ray" in out:
        out["speedup_2x1_ray_over_1x2"] = out["2x1-ray"]["tok_s"] / out["1x2"]["tok_s"]
    return out


def table(result: dict[str, Any]) -> str:
    head = f"{'config':<8}{'tok/s':>9}{'steps':>8}{'bubble':>9}{'handoff ms/step':>17}"
    lines = [head + f"{'= 1 stage':>11}"]
    for name in (n for n in CONFIGS if n in result):
        r = result[name]
        lines.append(
            f"{name:<8}{r['tok_s']:>9.1f}{r['steps']:>8.0f}{r['bubble_fraction']:>9.3f}"
            f"{r['handoff_ms_per_step']:>17.3f}{r['tokens_equal_1_stage']!s:>11}"
        )
    lines.append(f"2x1 / 1x2 throughput: {result['speedup_2x1_over_1x2']:.2f}x")
    if "speedup_2x1_ray_over_1x2" in result:
        lines.append(f"2x1-ray / 1x2 throughput: {result['speedup_2x1_ray_over_1x2']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--ray", action="store_true", help="add 2x1-ray: stage actors")
    parser.add_argument("--out", default="benchmarks/results/pipeline.json")
    parser.add_argument("--worker", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(run_config(args, args.worker)))
        return
    names = [n for n in CONFIGS if args.ray or not n.endswith("-ray")]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:  # interleaved, so drift in the machine's load hits both
            runs[name].append(spawn(args, name))
    result = {"args": {k: v for k, v in vars(args).items() if not k.startswith("worker")},
              **summary(runs)}
    print(table(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
