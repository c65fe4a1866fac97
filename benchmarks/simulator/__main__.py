"""python -m benchmarks.simulator {roofline,calibrate,offline,online,overhead,scale,pipeline,
prefix,tp,conditional_disagg,all}

Each command prints its tables and writes DIR/<command>.json and PNG plots. The paper's
experiments run on 4 simulated A100-40GB (Llama-2-13B, tensor parallel 2: one prefill and
one decode worker, or two static-batching replicas), K/V over NVLink. `prefix` scales the
same workers out (`--prefix-prefill`, `--prefix-decode`) for cache-aware placement against
least-loaded on shared prefixes.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from benchmarks.simulator import plots
from benchmarks.simulator.calibration import calibration_table, run_calibration
from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.conditional import conditional_table, run_conditional
from benchmarks.simulator.offline import offline_table, run_offline
from benchmarks.simulator.online import online_table, run_online
from benchmarks.simulator.overhead import overhead_table, run_overhead
from benchmarks.simulator.pipeline import pipeline_table, run_pipeline
from benchmarks.simulator.prefix import PREFIX_CLUSTER, PREFIX_WORKLOAD, prefix_table, run_prefix
from benchmarks.simulator.report import write_json
from benchmarks.simulator.roofline_table import roofline_table, run_roofline_table
from benchmarks.simulator.scale import run_scale, scale_table
from benchmarks.simulator.tensor_parallel import run_tp, tp_table

PAPER_CLUSTER = ClusterConfig(
    model="llama-2-13b", hardware="a100-40gb", link="nvlink3", num_prefill=1, num_decode=1, tp=2
)
COMMANDS = (
    "roofline", "calibrate", "offline", "online", "overhead", "scale", "pipeline", "prefix", "tp",
    "conditional_disagg",
)  # fmt: skip


def experiments(args: argparse.Namespace) -> dict[str, tuple[Callable, Callable, Callable]]:
    """command -> (run, table, plot)"""
    return {
        "roofline": (run_roofline_table, roofline_table, lambda result, out: []),
        "calibrate": (
            lambda: run_calibration(rounds=args.rounds),
            calibration_table,
            plots.plot_calibration,
        ),
        "offline": (
            lambda: run_offline(PAPER_CLUSTER, seeds=args.seeds),
            offline_table,
            plots.plot_offline,
        ),
        "online": (
            lambda: run_online(PAPER_CLUSTER, duration_s=args.duration),
            online_table,
            plots.plot_online,
        ),
        "overhead": (
            lambda: run_overhead(PAPER_CLUSTER, duration_s=args.duration),
            overhead_table,
            plots.plot_overhead,
        ),
        "scale": (
            lambda: run_scale(rate=args.scale_rate, duration_s=args.scale_duration),
            scale_table,
            lambda result, out: [],
        ),
        "pipeline": (
            lambda: run_pipeline(duration_s=args.duration),
            pipeline_table,
            lambda result, out: [],
        ),
        "prefix": (
            lambda: run_prefix(
                dataclasses.replace(
                    PREFIX_CLUSTER, num_prefill=args.prefix_prefill, num_decode=args.prefix_decode
                ),
                dataclasses.replace(
                    PREFIX_WORKLOAD,
                    num_prefixes=args.prefixes,
                    prefix_len=args.prefix_len,
                    zipf=args.zipf,
                ),
                duration_s=args.duration,
            ),
            prefix_table,
            lambda result, out: [],
        ),
        "tp": (lambda: run_tp(duration_s=args.duration), tp_table, lambda result, out: []),
        "conditional_disagg": (
            lambda: run_conditional(duration_s=args.duration),
            conditional_table,
            lambda result, out: [],
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.simulator", description=__doc__)
    parser.add_argument("command", choices=(*COMMANDS, "all"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/simulator"))
    parser.add_argument("--rounds", type=int, default=9, help="calibrate: timing rounds")
    parser.add_argument("--seeds", type=int, default=3, help="offline: seeds per point")
    parser.add_argument(
        "--duration", type=float, default=120.0, help="online, prefix: seconds of arrivals"
    )
    parser.add_argument("--scale-rate", type=float, default=10_000.0)
    parser.add_argument("--scale-duration", type=float, default=5.0, help="seconds of arrivals")
    prefix = parser.add_argument_group("prefix: the cluster and the shared prefixes")
    prefix.add_argument("--prefix-prefill", type=int, default=PREFIX_CLUSTER.num_prefill)
    prefix.add_argument("--prefix-decode", type=int, default=PREFIX_CLUSTER.num_decode)
    prefix.add_argument("--prefixes", type=int, default=PREFIX_WORKLOAD.num_prefixes)
    prefix.add_argument("--prefix-len", type=int, default=PREFIX_WORKLOAD.prefix_len)
    prefix.add_argument(
        "--zipf", type=float, default=PREFIX_WORKLOAD.zipf, help="0: uniform over prefixes"
    )
    args = parser.parse_args(argv)
    if args.zipf < 0:
        parser.error(f"--zipf must be >= 0, got {args.zipf}")
    for name, value in (
        ("--rounds", args.rounds),
        ("--seeds", args.seeds),
        ("--duration", args.duration),
        ("--scale-rate", args.scale_rate),
        ("--scale-duration", args.scale_duration),
        ("--prefix-prefill", args.prefix_prefill),
        ("--prefix-decode", args.prefix_decode),
        ("--prefixes", args.prefixes),
        ("--prefix-len", args.prefix_len),
    ):
        if value <= 0:
            parser.error(f"{name} must be positive, got {value}")
    logging.getLogger("bucket_manager").setLevel(logging.ERROR)  # graph-miss warnings
    chosen = COMMANDS if args.command == "all" else (args.command,)
    table_of = experiments(args)
    for command in chosen:
        run, table, plot = table_of[command]
        result = run()
        print(table(result), flush=True)
        path = write_json(args.out / f"{command}.json", result)  # first: a plot may fail
        for png in plot(result, args.out):
            print(f"wrote {png}")
        print(f"wrote {path}\n", flush=True)


if __name__ == "__main__":
    main()
