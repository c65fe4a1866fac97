"""Disaggregation overhead: the offline workload through 1 prefill + 1 decode worker vs the
in-process engine, SmolLM2-135M float32 on CPU.

The workload is offline_throughput's (chat messages, half short questions,
half long-answer requests, all arriving at t=0, greedy, `--max-new-tokens`).
The systems are built once in this one driver process and then run in turn,
interleaved within each repeat, so they share one environment and drift on a
shared machine hits them alike:

- `engine`: `runtime.LLM`, stepped on a worker thread as the decode worker's
  loop is (on a loaded machine libgomp makes main-thread steps far slower);
- `disagg-inprocess`: the Controller in local mode, both workers in this
  process, KV copied in-process;
- `disagg-ray`: the Controller with both workers as Ray actors (local Ray),
  KV through the Ray object store.

Both the engine and the workers take up to `--max-batched-tokens` prompt tokens
(default 8192, an offline budget) per prefill step or batch.

(Running each system in its own process instead slowed the engine alone on a
shared 2-core machine, for reasons outside the code paths compared, so the
pairing is in-process.) Per system: total output tok/s,
wall time and its ratio to the engine's (within each repeat), TTFT p50/p99
from t=0, KV bytes moved, KV transfer time (send + receive) per request and per
transfer, the transport's GB/s, and whether every sequence equals the
engine's. Medians over `--repeats`.

    python -m benchmarks.disagg_overhead --num-prompts 64 --max-new-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.offline_throughput import (
    add_workload_args,
    load_prompts,
    median_of,
    summarize,
    write_json,
)

SYSTEMS = ("engine", "disagg-inprocess", "disagg-ray")
MODES = {"disagg-inprocess": "local", "disagg-ray": "ray"}
TARGET = 1.15  # disaggregated wall time / engine wall time


def controller_config(
    model: str | None,
    mode: str,
    max_model_len: int,
    max_num_seqs: int,
    max_batched_tokens: int,
    dtype: str = "float32",
    prefill_threads: int | None = None,
    decode_threads: int | None = None,
) -> Any:
    """1 prefill + 1 decode worker (`mode` local or ray), every other setting the service's
    default."""
    from bucketserve.controller.config import ControllerConfig
    from bucketserve.controller.service_limits import ServiceLimits
    from bucketserve.runtime.core.scheduler import SchedulerConfig
    from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

    runner = ModelRunnerConfig(model=model, dtype=dtype, device="cpu")
    buckets = ServiceLimits.default_buckets(max_model_len, runner.block_size, max_num_seqs)
    batching = buckets.batching.model_copy(update={"max_batched_tokens": max_batched_tokens})
    return ControllerConfig(
        runner=runner,
        buckets=dataclasses.replace(buckets, batching=batching),
        topology="disaggregated",  # what this benchmark measures
        mode=mode,
        ray_init_kwargs={"log_to_driver": False},
        prefill={"torch_threads": prefill_threads},
        # the engine's scheduling (fcfs, unchunked) as when these figures were taken
        decode={
            **SchedulerConfig(max_num_seqs=max_num_seqs).model_dump(),
            "torch_threads": decode_threads,
        },
    )


async def timed_stream(controller: Any, request: Any) -> tuple[list[int], float, float]:
    """A request's tokens, with the monotonic times its first and last token arrived."""
    ids: list[int] = []
    first = last = 0.0
    async for delta in controller.submit(request):
        if delta.token_ids:
            last = time.monotonic()
            first = first or last
            ids += delta.token_ids
        if delta.finished and delta.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"{request.request_id} ended with {delta}")
    return ids, first, last


class Disagg:
    """A started Controller serving the workload, run after run."""

    def __init__(self, args: argparse.Namespace, mode: str, max_model_len: int) -> None:
        from bucketserve.controller.controller import Controller

        self.args = args
        config = controller_config(
            args.model, mode, max_model_len, args.max_num_seqs, args.max_batched_tokens,
            prefill_threads=args.prefill_threads, decode_threads=args.decode_threads,
        )
        self.controller = Controller(config)
        self.runs = 0

    async def start(self, prompts: list[list[int]]) -> None:
        from bucketserve.messages import ServeRequest
        from bucketserve.runtime.core.sampling_params import SamplingParams

        await self.controller.start()
        warm = SamplingParams(temperature=0, max_tokens=4)
        await asyncio.gather(
            *(timed_stream(self.controller, ServeRequest(f"warm-{i}", p, warm))
              for i, p in enumerate(prompts[:2]))
        )
        await self.controller.drain(60)

    async def run(self, prompts: list[list[int]]) -> dict[str, Any]:
        from bucketserve.messages import ServeRequest
        from bucketserve.runtime.core.sampling_params import SamplingParams

        controller, self.runs = self.controller, self.runs + 1
        before = controller.stats()
        params = SamplingParams(temperature=0, max_tokens=self.args.max_new_tokens)
        t0_wall, t0 = time.perf_counter(), time.monotonic()
        requests = [ServeRequest(f"run{self.runs}-{i}", p, params, arrival_time=t0)
                    for i, p in enumerate(prompts)]
        runs = await asyncio.gather(*(timed_stream(controller, r) for r in requests))
        wall = time.perf_counter() - t0_wall
        stats = await controller.drain(60)
        if stats.kv_blocks_leaked or stats.leases_open:
            raise RuntimeError(f"the pools did not drain: {stats}")
        traces = [(len(ids), first, last) for ids, first, last in runs]
        result = summarize(t0, wall, traces, [r[0] for r in runs])
        transfers = stats.transfers - before.transfers
        transfer_s = stats.transfer_s - before.transfer_s
        kv_bytes = stats.kv_bytes_moved - before.kv_bytes_moved
        result.update(
            kv_bytes=kv_bytes,
            transfers=transfers,
            transfer_s=transfer_s,
            transfer_ms_per_request=1000 * transfer_s / len(prompts),
            transfer_ms_per_transfer=1000 * transfer_s / max(1, transfers),
            transfer_gb_s=kv_bytes / transfer_s / 1e9 if transfer_s else 0.0,
            transport=sorted({w.transport for w in stats.workers}),
        )
        return result


def run_engine(llm: Any, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    from bucketserve.runtime.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    t0_wall, t0 = time.perf_counter(), time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0_wall
    traces = [(len(o.token_ids), o.metrics.first_token_time, o.metrics.last_token_time)
              for o in outputs]
    return summarize(t0, wall, traces, [o.token_ids for o in outputs])


async def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    from bucketserve.runtime.core.sampling_params import SamplingParams
    from bucketserve.runtime.engine.llm import LLM

    pool = ThreadPoolExecutor(1, thread_name_prefix="engine")
    loop = asyncio.get_running_loop()
    llm = LLM(args.model, dtype="float32", device="cpu", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_batched_tokens)
    prompts = load_prompts(args, llm.tokenizer)
    warm = SamplingParams(temperature=0, max_tokens=4)
    await loop.run_in_executor(pool, lambda: llm.generate(prompts[:2], warm, use_tqdm=False))
    max_model_len = llm.engine.runner.max_model_len
    disagg = {s: Disagg(args, MODES[s], max_model_len) for s in args.systems if s != "engine"}
    try:
        for system in disagg.values():
            await system.start(prompts)
        runs = []
        for i in range(args.repeats):
            run = {}
            for name in args.systems:
                print(f"[repeat {i + 1}/{args.repeats}] {name} ...", flush=True)
                if name == "engine":
                    run[name] = await loop.run_in_executor(
                        pool, run_engine, llm, prompts, args.max_new_tokens
                    )
                else:
                    run[name] = await disagg[name].run(prompts)
            runs.append(run)
    finally:
        for system in disagg.values():
            await system.controller.shutdown()
        pool.shutdown()
    return runs


def report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    metrics = ("wall_s", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "ms_per_token")
    transfer = ("kv_bytes", "transfers", "transfer_ms_per_request", "transfer_ms_per_transfer",
                "transfer_gb_s")
    median: dict[str, dict[str, Any]] = {}
    for s in args.systems:
        median[s] = {m: median_of(runs, s, m) for m in metrics}
        if s == "engine":
            continue
        median[s].update({m: median_of(runs, s, m) for m in transfer})
        median[s]["transport"] = runs[-1][s]["transport"]
        if "engine" in args.systems:
            ratios = [run[s]["wall_s"] / run["engine"]["wall_s"] for run in runs]
            median[s]["wall_vs_engine"] = statistics.median(ratios)
            median[s]["tok_s_vs_engine"] = statistics.median(
                [run[s]["tok_s"] / run["engine"]["tok_s"] for run in runs]
            )
            median[s]["identical_to_engine"] = min(
                sum(a == b for a, b in zip(run[s]["token_ids"], run["engine"]["token_ids"],
                                           strict=True))
                for run in runs
            )
    out: dict[str, Any] = {"args": vars(args), "median": median, "targets": {}}
    for s, m in median.items():
        if "wall_vs_engine" in m:
            out["targets"][f"{s} wall <= {TARGET}x engine"] = {
                "value": m["wall_vs_engine"], "met": m["wall_vs_engine"] <= TARGET
            }
    out["runs"] = [{s: {k: v for k, v in r.items() if k != "token_ids"} for s, r in run.items()}
                   for run in runs]
    return out


def print_report(out: dict[str, Any]) -> None:
    args = out["args"]
    print(f"\n{args['num_prompts']} prompts, {args['max_new_tokens']} new tokens, greedy, "
          f"{args['model'] or 'SmolLM2-135M'} float32 on {os.cpu_count()} CPUs; "
          f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY')}; "
          f"medians of {args['repeats']} runs")
    header = (f"{'system':<17} {'wall s':>7} {'tok/s':>7} {'x engine':>9} {'TTFT p50':>9} "
              f"{'TTFT p99':>9} {'KV MB':>7} {'xfers':>6} {'ms/req':>7} {'ms/xfer':>8} "
              f"{'GB/s':>6} {'same':>5}")
    print(header + "\n" + "-" * len(header))
    for name, m in out["median"].items():
        ratio = f"x{m['wall_vs_engine']:.3f}" if "wall_vs_engine" in m else ""
        line = (f"{name:<17} {m['wall_s']:>7.2f} {m['tok_s']:>7.1f} {ratio:>9} "
                f"{m['ttft_p50_ms']:>7.0f}ms {m['ttft_p99_ms']:>7.0f}ms")
        if "kv_bytes" in m:
            line += (f" {m['kv_bytes'] / 1e6:>7.1f} {m['transfers']:>6.0f} "
                     f"{m['transfer_ms_per_request']:>7.2f} {m['transfer_ms_per_transfer']:>8.2f} "
                     f"{m['transfer_gb_s']:>6.2f} {m.get('identical_to_engine', ''):>5}")
        print(line)
    for name, t in out["targets"].items():
        print(f"target {name}: x{t['value']:.3f} {'met' if t['met'] else 'MISSED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, repeats=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--prefill-threads", type=int, default=None,
                        help="the Ray prefill actor's torch threads (default: all the cores)")
    parser.add_argument("--decode-threads", type=int, default=None,
                        help="the Ray decode actor's torch threads (default: all the cores)")
    parser.add_argument("--max-batched-tokens", type=int, default=8192,
                        help="prompt tokens in one prefill step of the engine and one prefill "
                        "batch of the workers (an offline run's budget, as vLLM's LLM class "
                        "raises max_num_batched_tokens; the service's default is 2048)")
    parser.add_argument("--out", default="benchmarks/results/disagg_overhead.json")
    args = parser.parse_args()
    args.systems = args.systems.split(",")
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.max_batched_tokens < 1:
        parser.error(f"--max-batched-tokens must be >= 1, got {args.max_batched_tokens}")
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch starts its threads
    out = report(args, asyncio.run(run_all(args)))
    print_report(out)
    write_json(out, args.out)


if __name__ == "__main__":
    main()
