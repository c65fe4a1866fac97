"""Conditional disaggregation on the laptop cluster: the fake-multinode recipe
(`bucketserve/deploy/cluster-local.yaml`, one prefill and one decode actor on fake cards,
serve-local.yaml) served with `controller.remote_prefill` auto, always and never, each
offered the same mixed short/long workload by `bucketserve bench` at rising rates.

A check of the direction only: every actor computes on the same two shared CPU cores, so
absolute figures say little about a cluster.

    python -m benchmarks.conditional_local --rates 0.5,1,2 \\
        --out benchmarks/results/disagg/conditional_local_zen3.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.offline_throughput import write_json
from benchmarks.ray_up_local import RECIPE, ROOT, _first_answer, _ray, ray_env, start_service

SERVE = ROOT / "bucketserve/deploy/serve-local.yaml"
MODES = ("auto", "always", "never")
BUCKETSERVE = str(Path(sys.executable).with_name("bucketserve"))


def one_mode(env: dict[str, str], mode: str, args: argparse.Namespace, work: Path) -> dict:
    """`ray up`, the service with `remote_prefill: mode`, the bench's sweep, `ray down`."""
    config = yaml.safe_load(SERVE.read_text())
    config["controller"]["remote_prefill"] = mode
    path = work / f"serve-{mode}.yaml"
    path.write_text(yaml.safe_dump(config))
    _ray(env, "up", RECIPE, "-y", "--no-config-cache")
    service, grpc, http = start_service(env, path)
    try:
        _first_answer(f"127.0.0.1:{grpc}", time.perf_counter() + args.timeout, service)
        bench = [
            BUCKETSERVE, "bench", "--target", f"127.0.0.1:{grpc}",
            "--metrics-url", f"http://127.0.0.1:{http}/metrics", "--workload", "mixed",
            "--long-fraction", str(args.long_fraction), "--max-model-len", "1024",
            "--rates", args.rates, "--num-requests", str(args.num_requests),
            "--output-mean", "32", "--output-max", "64", "--slo-ttft", str(args.slo_ttft),
            "--slo-tpot", str(args.slo_tpot), "--seed", str(args.seed), "--no-progress",
            "--out", str(work), "--name", mode,
        ]  # fmt: skip
        subprocess.run(bench, cwd=ROOT, check=True, timeout=3600)
        return json.loads((work / f"{mode}.json").read_text())
    finally:
        _ray(env, "down", RECIPE, "-y")
        service.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.5,1,2")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--long-fraction", type=float, default=0.3)
    parser.add_argument("--slo-ttft", type=float, default=3.0)
    parser.add_argument("--slo-tpot", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--timeout", type=float, default=600.0, help="s to the first answer")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bs-cond-home"))
    work = Path(tempfile.mkdtemp(prefix="bs-cond-"))
    results: dict[str, Any] = {}
    try:
        env = ray_env(home)
        for mode in args.modes.split(","):
            results[mode] = one_mode(env, mode, args, work)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    rows = []
    print(f"{'mode':>7} {'rate':>5} {'SLO%':>6} {'good/s':>7} {'TTFT p90 s':>10} paths")
    for mode, result in results.items():
        for run in result["runs"]:
            s, server = run["summary"], run["server"]
            paths = {k.split(":", 1)[1]: v for k, v in server.items()
                     if k.startswith("prefill_path:")}  # fmt: skip
            rows.append({"mode": mode, "rate": run["rate"], "slo_attainment": s["slo_attainment"],
                         "goodput": s["goodput"], "ttft_p90_s": s["ttft"]["p90"],
                         "paths": paths})  # fmt: skip
            print(f"{mode:>7} {run['rate']:>5g} {100 * s['slo_attainment']:>6.1f} "
                  f"{s['goodput']:>7.2f} {s['ttft']['p90']:>10.2f} {paths}")
    command = "python -m benchmarks.conditional_local " + shlex.join(sys.argv[1:])
    out = {"command": command, "rows": rows,
           "workload": results[next(iter(results))]["workload"]}
    if args.out:
        write_json(out, args.out)


if __name__ == "__main__":
    main()
