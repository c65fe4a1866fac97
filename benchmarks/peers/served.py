"""Served comparison: `vllm serve` and `bucketserve serve` on the same weights, one server at a
time, under the same `vllm bench serve` sweep from vLLM's own client.

    python -m benchmarks.peers.served --rates 1,2,3,4 --num-prompts 100 --seeds 0,1,2
    python -m benchmarks.peers.served --workload prefix --systems vllm,bucketserve-colocated

`--workload` picks what is sent: `random` (the default), `prefix` (a few long shared
prefixes), `multiturn` (conversations resending their history) or `structured` (JSON
extraction under a JSON schema, llguidance on both servers; each run also reports the share
of replies that validate); `served_workloads.py` says how each is built and its default
rates and sizes.

Both servers run with their defaults, automatic prefix caching on (`--no-prefix-caching`
turns it off in both, the setting of the earlier comparisons), and each run starts from an
empty cache: before it, every server is asked to forget its cached blocks
(`POST /reset_prefix_cache`; vLLM's needs `VLLM_SERVER_DEV_MODE=1`, set here), so a rate's
figures do not depend on the runs before it. Each run's prefix-cache hit rate (the share of
prompt tokens the server found cached, from the `prefix_cache_queries` / `prefix_cache_hits`
counters of its `/metrics`) is reported beside its latencies.

A bucketserve system is `bucketserve-<shape>` (Ray actors, the default) or
`bucketserve-<shape>-local` (`controller.mode: local`: the workers on threads of the server
process, no Ray).

One server at a time: each runs the whole sweep and is stopped before the next starts.
`--interleaved` starts every system first and lets them take turns (for each seed, for
each rate, every system, the order rotating with the rate): a shared VM can drift by more
between a sweep of one system and a later sweep of the other than the systems differ, but
the waiting servers keep using some of the cores, which costs the running one a little
TPOT. `--add-to` fills a rate into an earlier report.

For every run: requests completed and failed, output tok/s, TTFT and TPOT p50/p90, the
prefix-cache hit rate, and the share of requests meeting the SLO (TTFT <= 4 s and TPOT <=
0.25 s by default). Per system and rate the medians over the seeds; the rate at 80 %
attainment (interpolated over the median attainment, and per seed) and the ratio of each
bucketserve system's to vLLM's.
Writes a table, JSON and a plot (TTFT p90, TPOT p90 and attainment against rate).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.peers import served_workloads
from benchmarks.peers.harness import (
    ISA_ENV,
    PEER_PYTHON,
    REPO_ROOT,
    RESULTS_DIR,
    hold_to_isa,
    peer_env,
)
from benchmarks.simulator.report import rate_at

PEER_BIN = PEER_PYTHON.parent
SHAPES = ("colocated", "disaggregated")
SERVED_NAME = "SmolLM2-135M-Instruct"
# vLLM serves POST /reset_prefix_cache only in its dev mode.
VLLM_RESET_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
# bucketserve's /metrics shows the workers' counters as of its last stats poll (1 s apart).
STATS_WAIT_S = 2.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir() -> Path:
    """The safetensors copy bucketserve serves (converted from the wheel's GGUF once)."""
    from bucketserve.runtime.loader.model_files import resolve_model

    return resolve_model(None)


class Server:
    """One server process on a free port, stopped (SIGINT, then SIGKILL) when done."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int) -> None:
        self.name, self.port = name, port
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - open while the server runs
            "w+", prefix=f"{name}-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            argv, cwd=REPO_ROOT, env={**os.environ, **env}, stdout=self.log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.started = time.monotonic()

    def wait_ready(self, timeout_s: float = 600) -> float:
        url = f"http://127.0.0.1:{self.port}/v1/models"
        while time.monotonic() - self.started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; its log: {self.log.name}")
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        return time.monotonic() - self.started
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"{self.name} not ready in {timeout_s} s; its log: {self.log.name}")

    def reset_prefix_cache(self) -> bool:
        """Ask the server to forget its cached prefix blocks; whether it said it did."""
        url = f"http://127.0.0.1:{self.port}/reset_prefix_cache"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="POST"),
                                        timeout=30) as reply:
                body = reply.read().decode() or "{}"
        except OSError:
            return False
        return json.loads(body).get("success", True) is not False

    def prefix_cache_counts(self) -> tuple[float, float] | None:
        """(queries, hits) of the server's prefix cache so far, in prompt tokens; None when
        its `/metrics` has no such counters."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics",
                                        timeout=10) as reply:
                return prefix_cache_counts(reply.read().decode())
        except OSError:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


# `vllm:prefix_cache_hits_total{...} 123.0`, `bucketserve:prefix_cache_queries_total 4.0`;
# not vLLM's `external_prefix_cache_*` (a KV connector's).
_COUNTER = re.compile(r"^[a-z_]+:prefix_cache_(queries|hits)(?:_total)?(?:\{[^}]*\})? (\S+)$",
                      re.MULTILINE)


def prefix_cache_counts(metrics: str) -> tuple[float, float] | None:
    """(queries, hits) summed over every series of a Prometheus text page; None if absent."""
    found = {"queries": 0.0, "hits": 0.0}
    seen = False
    for kind, value in _COUNTER.findall(metrics):
        found[kind] += float(value)
        seen = True
    return (found["queries"], found["hits"]) if seen else None


def hit_rate(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float:
    """The share of the prompt tokens looked up between two scrapes that were cached (NaN
    when either scrape had no counters or nothing was looked up)."""
    if before is None or after is None or after[0] <= before[0]:
        return math.nan
    return (after[1] - before[1]) / (after[0] - before[0])


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """What `start` reads from the command line: both servers' dtype and limits."""
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--isa", default=None, choices=sorted(ISA_ENV),
                        help="hold both servers to this ISA on a CPU that has more")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--decode-config", default="",
                        help="more keys of bucketserve's controller.decode, YAML flow style "
                        "(e.g. 'slo_admission: false')")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="both servers without automatic prefix caching (vLLM's "
                        "--no-enable-prefix-caching, bucketserve's kv_cache."
                        "enable_prefix_caching: false)")


def require_peer_venv(*modules: str) -> None:
    """The peer venv exists and imports `modules` (what a workload's dataset needs)."""
    if not (PEER_BIN / "vllm").is_file():
        raise SystemExit(f"no peer venv at {PEER_BIN.parent}; run benchmarks/peers/setup.sh")
    for module in modules:
        if subprocess.run([str(PEER_PYTHON), "-c", f"import {module}"],
                          capture_output=True, check=False).returncode:
            raise SystemExit(f"the peer venv lacks {module}; run benchmarks/peers/setup.sh")


def start(
    system: str, model: Path, args: argparse.Namespace, env: dict[str, str] | None = None
) -> Server:
    """`system` on a free port with the workload's dtype and limits; `env` over the usual."""
    env = env or {}
    port = free_port()
    caching = not getattr(args, "no_prefix_caching", False)
    if system == "vllm":
        argv = [
            str(PEER_BIN / "vllm"), "serve", str(model), "--served-model-name", SERVED_NAME,
            "--port", str(port), "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
            "--max-model-len", str(args.max_model_len),
            *([] if caching else ["--no-enable-prefix-caching"]),
            *served_workloads.vllm_serve_args(args),
        ]
        return Server(system, argv, {**peer_env(), **env}, port)
    shape, local = _shape_mode(system)
    config = Path(tempfile.mkstemp(prefix=f"{system}-", suffix=".yaml")[1])
    config.write_text(
        f"model: {{dtype: {args.dtype}, max_model_len: {args.max_model_len}}}\n"
        + ("" if caching else "kv_cache: {enable_prefix_caching: false}\n")
        + f"controller:\n  topology: {shape}\n  mode: {'local' if local else 'ray'}\n"
        f"  decode: {{max_num_seqs: {args.max_num_seqs}"
        f"{', ' + args.decode_config if args.decode_config else ''}}}\n"
        f"gateway: {{http_port: {port}, grpc_port: {free_port()}}}\n"
    )
    argv = [sys.executable, "-m", "bucketserve.cli", "serve", "--config", str(config)]
    return Server(system, argv, env, port)


def _start(system: str, model: Path, args: argparse.Namespace) -> Server:
    return start(system, model, args, VLLM_RESET_ENV if system == "vllm" else None)


def _shape_mode(system: str) -> tuple[str, bool]:
    """`bucketserve-<shape>[-local]` -> (shape, whether the workers run without Ray)."""
    shape = system.removeprefix("bucketserve-")
    return shape.removesuffix("-local"), shape.endswith("-local")


def bench_argv(
    server: Server, model: Path, rate: float, args: argparse.Namespace, out: Path, name: str,
    dataset: Path | None = None,
) -> list[str]:
    """The `vllm bench serve` command of one run of `args.workload` at `rate`."""
    return [
        str(PEER_BIN / "vllm"), "bench", "serve",
        *served_workloads.dataset_args(args, dataset),
        "--base-url", f"http://127.0.0.1:{server.port}",
        "--model", SERVED_NAME, "--tokenizer", str(model),
        *(["--ignore-eos"] if served_workloads.ignores_eos(args) else []),
        "--num-prompts", str(args.num_prompts), "--request-rate", f"{rate:g}",
        "--seed", str(args.seed), "--temperature", f"{getattr(args, 'temperature', 0.0):g}",
        "--save-result", "--save-detailed",
        "--result-dir", str(out), "--result-filename", name,
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90",
    ]


def bench(
    server: Server, model: Path, rate: float, args: argparse.Namespace, out: Path,
    dataset: Path | None = None,
) -> dict:
    """One `vllm bench serve` run from an empty prefix cache; its saved result with
    per-request details, `prefix_cache_hit_rate` over the run and, for the structured
    workload, `schema_valid`."""
    name = f"{server.name}-r{rate:g}-s{args.seed}.json"
    if not server.reset_prefix_cache():
        print(f"warning: {server.name} did not reset its prefix cache before this run",
              file=sys.stderr)
    before = server.prefix_cache_counts()
    argv = bench_argv(server, model, rate, args, out, name, dataset)
    subprocess.run(argv, cwd=REPO_ROOT, env={**os.environ, **peer_env()}, check=True,
                   stdout=subprocess.DEVNULL)
    time.sleep(STATS_WAIT_S)
    raw = json.loads((out / name).read_text())
    raw["prefix_cache_hit_rate"] = hit_rate(before, server.prefix_cache_counts())
    valid = served_workloads.schema_valid(args, raw)
    if valid is not None:
        raw["schema_valid"] = valid
    return raw


def summarize(raw: dict, rate: float, slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
    ttfts, itls = raw.get("ttfts", []), raw.get("itls", [])
    errors = raw.get("errors", [])
    ok = [
        ttft <= slo_ttft and (statistics.fmean(itl) if itl else 0.0) <= slo_tpot
        for ttft, itl, err in zip(ttfts, itls, errors or [""] * len(ttfts), strict=False)
        if not err
    ]
    total = raw.get("num_prompts") or len(ttfts)
    return {
        "rate": rate,
        "completed": raw["completed"],
        "failed": total - raw["completed"],
        "output_tok_s": raw["output_throughput"],
        "ttft_p50_s": raw["p50_ttft_ms"] / 1e3,
        "ttft_p90_s": raw["p90_ttft_ms"] / 1e3,
        "tpot_p50_ms": raw["p50_tpot_ms"],
        "tpot_p90_ms": raw["p90_tpot_ms"],
        "slo_attainment": sum(ok) / total if total else 0.0,
        "prefix_cache_hit_rate": raw.get("prefix_cache_hit_rate", math.nan),
        **({"schema_valid": raw["schema_valid"]} if "schema_valid" in raw else {}),
    }


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for system, runs in results.items():
        rates = [r["rate"] for r in runs]
        axes[0].plot(rates, [r["ttft_p90_s"] for r in runs], marker="o", label=system)
        axes[1].plot(rates, [r["tpot_p90_ms"] for r in runs], marker="o", label=system)
        axes[2].plot(rates, [100 * r["slo_attainment"] for r in runs], marker="o", label=system)
    axes[0].set(xlabel="request rate (req/s)", ylabel="TTFT p90 (s)", yscale="log")
    axes[1].set(xlabel="request rate (req/s)", ylabel="TPOT p90 (ms)")
    axes[2].set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)")
    axes[2].axhline(80, color="grey", linestyle=":")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="vllm,bucketserve-colocated,"
                        "bucketserve-disaggregated")
    served_workloads.add_workload_args(parser)
    add_server_args(parser)
    parser.add_argument("--seeds", default="0", help="comma-separated; medians over them")
    parser.add_argument("--interleaved", action="store_true",
                        help="every server up at once, taking turns per rate (cancels "
                        "drift; the idle ones share the cores)")
    parser.add_argument("--add-to", type=Path, default=None,
                        help="an earlier served.json of the same systems and seeds: its runs "
                        "at other rates join this sweep's in the report (fills in a rate)")
    parser.add_argument("--slo-ttft", type=float, default=4.0)
    parser.add_argument("--slo-tpot", type=float, default=0.25)
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/results/peers_served (random), "
                        "peers_served_<workload> (the others)")
    args = parser.parse_args()
    served_workloads.resolve(args, parser)
    if args.out is None:
        suffix = "" if args.workload == "random" else f"_{args.workload}"
        args.out = RESULTS_DIR / f"peers_served{suffix}"
    hold_to_isa(args.isa)
    require_peer_venv(*served_workloads.PEER_MODULES.get(args.workload, ()))
    systems = args.systems.split(",")
    for system in systems:
        if system != "vllm" and _shape_mode(system)[0] not in SHAPES:
            raise SystemExit(
                f"unknown system {system!r}: vllm or bucketserve-<{'|'.join(SHAPES)}>[-local]"
            )
    rates = [float(r) for r in args.rates.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    model = model_dir()
    by_seed: dict[str, dict[int, list[dict]]] = {s: {seed: [] for seed in seeds} for s in systems}

    datasets = {}
    for seed in seeds:
        args.seed = seed
        datasets[seed] = served_workloads.prepare(args, model, args.out)

    def run(server: Server, rate: float, seed: int) -> None:
        args.seed = seed
        raw = bench(server, model, rate, args, args.out, datasets[seed])
        row = summarize(raw, rate, args.slo_ttft, args.slo_tpot)
        by_seed[server.name][seed].append(row)
        print(server.name, f"seed {seed}", json.dumps(row), flush=True)

    startup: dict[str, float] = {}
    if not args.interleaved:  # one server at a time
        for system in systems:
            server = _start(system, model, args)
            try:
                startup[system] = server.wait_ready()
                for seed in seeds:
                    for rate in rates:
                        run(server, rate, seed)
            finally:
                server.stop()
    else:
        servers: list[Server] = []
        try:
            for system in systems:
                servers.append(_start(system, model, args))
            for server in servers:
                startup[server.name] = server.wait_ready()
            for seed in seeds:
                for i, rate in enumerate(rates):
                    for server in servers[i % len(servers):] + servers[: i % len(servers)]:
                        run(server, rate, seed)
        finally:
            for server in servers:
                server.stop()
    earlier = json.loads(args.add_to.read_text()) if args.add_to else None
    if earlier is not None:
        by_seed = _merged(earlier["runs_by_seed"], by_seed)
    results = {s: _medians([runs for runs in by_seed[s].values()]) for s in systems}
    at = {
        s: rate_at([r["rate"] for r in runs], [r["slo_attainment"] for r in runs])
        for s, runs in results.items()
    }
    at_by_seed = {
        s: {
            seed: rate_at([r["rate"] for r in runs], [r["slo_attainment"] for r in runs])
            for seed, runs in by_seed[s].items()
        }
        for s in systems
    }
    report = {
        "command": " ".join(sys.argv),
        "workload": vars(args) | {"out": str(args.out), "add_to": args.add_to and str(args.add_to),
                                  "datasets": {s: d and str(d) for s, d in datasets.items()}},
        "interleaved": args.interleaved,
        "added_to": earlier and {"command": earlier["command"], "path": str(args.add_to)},
        "startup_s": startup,
        "runs": results,
        "runs_by_seed": by_seed,
        "rate_at_80pct_slo": at,
        "rate_at_80pct_slo_by_seed": at_by_seed,
        "ratio_vs_vllm": {
            s: (at[s] / at["vllm"]) if at.get("vllm") and at[s] else None
            for s in results if s != "vllm"
        },
    }
    (args.out / "served.json").write_text(json.dumps(report, indent=2))
    plot(results, args.out / "served.png")
    print(f"workload {args.workload}, medians over seeds {seeds}")
    header = f"{'system':28} {'R':>4} {'ok/fail':>8} {'tok/s':>7} {'TTFT p50/p90 s':>15} " \
             f"{'TPOT p50/p90 ms':>16} {'hit':>5} {'SLO':>5}" \
             + (f" {'valid':>5}" if args.workload == "structured" else "")
    print(header)
    for system, runs in results.items():
        for r in runs:
            hit = r.get("prefix_cache_hit_rate", math.nan)
            print(f"{system:28} {r['rate']:4g} {r['completed']:>4g}/{r['failed']:<3g} "
                  f"{r['output_tok_s']:7.1f} {r['ttft_p50_s']:7.2f}/{r['ttft_p90_s']:<7.2f} "
                  f"{r['tpot_p50_ms']:8.0f}/{r['tpot_p90_ms']:<7.0f} "
                  + (f"{hit:5.0%}" if not math.isnan(hit) else f"{'-':>5}")
                  + f" {r['slo_attainment']:5.0%}"
                  + (f" {r['schema_valid']:5.0%}" if "schema_valid" in r else ""))
    print("rate at 80 % SLO:", {s: round(v, 2) if v else v for s, v in at.items()})
    above = [s for s, runs in results.items() if runs[-1]["slo_attainment"] >= 0.8]
    if above:
        print("  (a lower bound, still >= 80 % at the top rate:", ", ".join(above) + ")")
    print("  per seed:", at_by_seed)
    print("ratio vs vllm:", report["ratio_vs_vllm"])


def _merged(
    earlier: dict[str, dict[str, list[dict]]], now: dict[str, dict[int, list[dict]]]
) -> dict[str, dict[int, list[dict]]]:
    """`now`'s runs with `earlier`'s (JSON: seeds as strings) at the rates `now` lacks,
    each sweep in rate order."""
    merged = {}
    for system, seeds in now.items():
        merged[system] = {}
        for seed, runs in seeds.items():
            have = {r["rate"] for r in runs}
            old = [r for r in earlier[system][str(seed)] if r["rate"] not in have]
            merged[system][seed] = sorted(runs + old, key=lambda r: r["rate"])
    return merged


def _medians(sweeps: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per rate, the median of each figure over the seeds' sweeps (same rates in order)."""
    return [
        {key: _median([r.get(key, math.nan) for r in rows]) for key in rows[0]}
        for rows in zip(*sweeps, strict=True)
    ]


def _median(values: list[float]) -> float:
    """The median of the values that are numbers (NaN: a figure a run could not take)."""
    known = [v for v in values if not math.isnan(v)]
    return statistics.median(known) if known else math.nan


if __name__ == "__main__":
    main()
