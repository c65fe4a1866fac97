"""`bucketserve bench`: the load generator, and `--compare`, which runs it against the service
in several configurations."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bucketserve.bench.request import WORKLOADS

RESULTS = Path("benchmarks/results/loadgen")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="load-test a server: Poisson or closed-loop load, SLO attainment, goodput",
        description="Drive a bucketserve (gRPC) or any OpenAI-compatible server with a seeded "
        "workload and report throughput, TTFT/TPOT/e2e percentiles, SLO attainment and "
        "goodput; --compare starts the service itself in several configurations.",
    )
    target = p.add_argument_group("target")
    target.add_argument("--backend", choices=("grpc", "openai"), default="grpc")
    target.add_argument("--target", default="127.0.0.1:50051", help="gRPC host:port")
    target.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                        help="OpenAI API base URL (--backend openai)")
    target.add_argument("--model", help="served model name (--backend openai)")
    target.add_argument("--metrics-url", default="http://127.0.0.1:8000/metrics",
                        help="Prometheus endpoint to scrape before/after ('' to skip)")
    target.add_argument("--tokenizer", help="model dir or .gguf whose tokenizer sizes prompts "
                        "(default: the embedded SmolLM2)")
    target.add_argument("--allow-remote", action="store_true",
                        help="allow a target that is not a loopback address")
    load = p.add_argument_group("load")
    load.add_argument("--rate", type=float, action="append", dest="rates", default=[],
                      help="open-loop Poisson request rate, req/s (repeatable)")
    load.add_argument("--rates", type=_floats, dest="rate_list", help="comma-separated sweep")
    load.add_argument("--concurrency", type=int, default=0, help="closed loop of N clients")
    load.add_argument("--num-requests", type=int, default=100)
    load.add_argument("--duration", type=float, help="stop sending after this many seconds")
    load.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, s")
    work = p.add_argument_group("workload")
    work.add_argument("--workload", choices=WORKLOADS, default="mixed")
    work.add_argument("--long-fraction", type=float, default=0.2,
                      help="share of long requests (mixed), of documents (prefix-flood)")
    work.add_argument("--system-prompt-len", type=int, default=1024,
                      help="prefix-flood: tokens of the chat requests' shared system prompt")
    work.add_argument("--max-model-len", type=int, default=1024,
                      help="prompt + output stay within this (the server's model length)")
    work.add_argument("--output-mean", type=float, default=128.0,
                      help="mean output tokens (log-normal, sigma 0.5)")
    work.add_argument("--output-max", type=int, default=256)
    work.add_argument("--sharegpt-path", help="a ShareGPT JSON file instead of the package's")
    work.add_argument("--sharegpt-max-records", type=int, default=0)
    work.add_argument("--tenant", action="append", default=[], metavar="NAME[:KEY][@KIND][=SHARE]",
                      help="tenant mix, e.g. chat:chat-key=0.8 batch:batch-key@long (repeatable)")
    work.add_argument("--seed", type=int, default=0)
    slo = p.add_argument_group("SLO and output")
    slo.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT target, seconds")
    slo.add_argument("--slo-tpot", type=float, default=0.2, help="TPOT target, seconds")
    slo.add_argument("--slo-kind", action="append", default=[], type=_kind_slo,
                     metavar="KIND=TTFT,TPOT",
                     help="targets of one workload kind (short, long, sharegpt), e.g. "
                     "long=20,0.25 for offline long-document requests (repeatable); results "
                     "also report attainment under the base targets alone")
    slo.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    slo.add_argument("--name", default="bench", help="results file stem")
    slo.add_argument("--no-progress", action="store_true")
    slo.add_argument("--save-records", action="store_true",
                     help="also write every request's record to NAME.records.json")
    cmp = p.add_argument_group("comparison (--compare)")
    cmp.add_argument("--compare", action="store_true",
                     help="start the service in several configurations and compare them")
    cmp.add_argument("--systems", help="comma-separated, from bucketserve,fcfs,fcfs-slo,fcfs-fit,"
                     "shape-only (default: bucketserve,fcfs,shape-only; bucketserve,fcfs with "
                     "--padded or --execution graphs; fcfs-fit only then), and the tenant "
                     "pairs cache-shares,no-cache-shares (--workload prefix-flood) and "
                     "shed,queue (the chat tenant's TTFT target: --slo-ttft)")
    cmp.add_argument("--serve-model", help="model the harness serves (default: embedded)")
    cmp.add_argument("--num-kv-blocks", type=int, help="decode KV pool of the started service")
    cmp.add_argument("--padded", action="store_true",
                     help="every system pads its batches to the shape buckets, as HPU and CUDA "
                     "graphs do (on the CPU nothing is padded by default)")
    cmp.add_argument("--execution", choices=("auto", "eager", "graphs"), default="auto",
                     help="the started services' execution mode: graphs compiles one graph per "
                     "shape bucket at warm-up (and so pads, like --padded); auto is eager on CPU")
    cmp.add_argument("--topology", "--shape", choices=("colocated", "disaggregated"),
                     help="the started services' deployment topology (default: the "
                     "service's; --shape: its old name)")
    cmp.add_argument("--batch-max-wait", type=float, metavar="SECONDS",
                     help="bucketserve's offline batch tenant: its requests go first once they "
                     "waited this long, whatever its priority (default: the tenant default, 30)")
    cmp.add_argument("--decode-pace", type=float, metavar="FRACTION",
                     help="every system's controller.decode.pace (disaggregated): decode steps "
                     "wait for a prefill batch until a request would get its next token later "
                     "than this fraction of --slo-tpot, which becomes every tenant's TPOT target")
    cmp.add_argument("--aggregate", type=Path, nargs="+", metavar="JSON",
                     help="print the medians of earlier --compare results and exit")
    p.set_defaults(func=run)


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        msg = f"--rates takes numbers like 0.5,1,2; got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def _kind_slo(text: str) -> tuple[str, tuple[float, float]]:
    kind, _, targets = text.partition("=")
    try:
        ttft, tpot = (float(x) for x in targets.split(","))
    except ValueError:
        msg = f"--slo-kind takes KIND=TTFT,TPOT in seconds, like long=20,0.25; got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    return kind.strip(), (ttft, tpot)


def build_config(args: argparse.Namespace) -> Any:
    from bucketserve.bench.config import BenchConfig
    from bucketserve.bench.length_distribution import LengthDistribution
    from bucketserve.bench.slo import SLO
    from bucketserve.bench.tenant_mix import TenantShare
    from bucketserve.bench.workload import WorkloadConfig

    output = LengthDistribution(args.output_mean, 0.5, 1, args.output_max)
    workload = WorkloadConfig(
        name=args.workload, num_requests=args.num_requests, seed=args.seed,
        max_model_len=args.max_model_len, long_fraction=args.long_fraction, output=output,
        sharegpt_path=args.sharegpt_path, sharegpt_max_records=args.sharegpt_max_records,
        system_prompt_len=args.system_prompt_len,
    )
    return BenchConfig(
        backend=args.backend, target=args.target, base_url=args.base_url,
        served_model=args.model, metrics_url=args.metrics_url or None,
        model_path=args.tokenizer or args.serve_model, workload=workload,
        tenants=[TenantShare.parse(t) for t in args.tenant],
        rates=[*args.rates, *(args.rate_list or [])], concurrency=args.concurrency,
        duration_s=args.duration, slo=SLO(args.slo_ttft, args.slo_tpot, dict(args.slo_kind)),
        timeout_s=args.timeout, allow_remote=args.allow_remote, progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    try:
        if args.aggregate:
            return _aggregate(args.aggregate)
        config = build_config(args)
        if args.compare:
            return _compare(args, config)
        return _bench(args, config)
    except ValueError as exc:
        print(f"bucketserve bench: {exc}", file=sys.stderr)
        return 2


def _bench(args: argparse.Namespace, config: Any) -> int:
    from bucketserve.bench.bench import Bench, write_json
    from bucketserve.bench.plots import plot_sweeps
    from bucketserve.bench.report import bench_table

    bench = Bench(config)
    result = bench.run()
    path = write_json(result, args.out / f"{args.name}.json")
    if args.save_records:
        _save_records({config.backend: bench}, args.out / f"{args.name}.records.json")
    plots = plot_sweeps({config.backend: result["runs"]}, args.out / args.name,
                        f"{config.workload.name} workload")
    print(bench_table(result))
    print(f"results: {path}; plots: {', '.join(map(str, plots))}")
    return 0


def _compare(args: argparse.Namespace, config: Any) -> int:
    from bucketserve.bench.bench import write_json
    from bucketserve.bench.comparison import Comparison, ServiceSpec
    from bucketserve.bench.plots import plot_sweeps
    from bucketserve.bench.report import compare_table

    spec = ServiceSpec(model=args.serve_model, max_model_len=args.max_model_len,
                       num_kv_blocks=args.num_kv_blocks, padded=args.padded,
                       execution=args.execution, topology=args.topology,
                       batch_max_wait_s=args.batch_max_wait, decode_pace=args.decode_pace,
                       tpot_slo_s=config.slo.tpot_s, ttft_slo_s=config.slo.ttft_s)
    names = args.systems or ("bucketserve,fcfs" if spec.pads else "bucketserve,fcfs,shape-only")
    systems = tuple(s.strip() for s in names.split(",") if s.strip())
    comparison = Comparison(config, spec, systems)
    result = comparison.run()
    path = write_json(result, args.out / f"{args.name}.json")
    if args.save_records:
        _save_records(comparison.benches, args.out / f"{args.name}.records.json")
    runs = {name: r["runs"] for name, r in result["systems"].items()}
    plots = plot_sweeps(runs, args.out / args.name, f"{config.workload.name} workload")
    print(compare_table(result))
    print(f"results: {path}; plots: {', '.join(map(str, plots))}")
    return 0


def _save_records(benches: dict[str, Any], path: Path) -> None:
    from bucketserve.bench.bench import write_json

    data = {
        name: {str(rate): [r.as_dict() for r in records] for rate, records in b.records.items()}
        for name, b in benches.items()
    }
    write_json(data, path)


def _aggregate(paths: list[Path]) -> int:
    import json

    from bucketserve.bench.report import aggregate_table

    try:
        results = [json.loads(p.read_text()) for p in paths]
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read a --compare result: {exc}") from exc
    if any("rate_at_target" not in r for r in results):
        raise ValueError("--aggregate takes JSON files written by `bucketserve bench --compare`")
    print(aggregate_table(results))
    return 0
