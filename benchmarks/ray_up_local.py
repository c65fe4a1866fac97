"""Wall time of the laptop cluster path: `ray up bucketserve/deploy/cluster-local.yaml` to the first
answered request (the service started with `ray exec`, bucketserve/deploy/serve-local.yaml, the
embedded SmolLM2), and `ray down` (which also ends the service).

    flock /tmp/bench.lock python -m benchmarks.ray_up_local --runs 3

The `ray` CLI runs with a HOME of its own holding a fresh Ray auth token, so this machine's
~/.ray is left alone; converted models come from the usual cache.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.offline_throughput import write_json
from bucketserve import Client, SamplingParams
from bucketserve.runtime.io.default_model import CACHE_ENV, cache_root

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "bucketserve/deploy/cluster-local.yaml"
RAY = str(Path(sys.executable).with_name("ray"))


def one_run(env: dict[str, str], timeout_s: float) -> dict[str, float]:
    t0 = time.perf_counter()
    _ray(env, "up", RECIPE, "-y", "--no-config-cache")
    t1 = time.perf_counter()
    service, grpc, _ = start_service(env, "bucketserve/deploy/serve-local.yaml")
    try:
        _first_answer(f"127.0.0.1:{grpc}", t1 + timeout_s, service)
        t2 = time.perf_counter()
    finally:
        t3 = time.perf_counter()
        _ray(env, "down", RECIPE, "-y")
        t4 = time.perf_counter()
        service.wait(timeout=60)
    return {"ray_up_s": t1 - t0, "serve_to_first_answer_s": t2 - t1,
            "up_to_first_answer_s": t2 - t0, "ray_down_s": t4 - t3}


def start_service(env: dict[str, str], config: str | Path) -> tuple[subprocess.Popen, int, int]:
    """`bucketserve serve --config config` on the cluster's head (`ray exec`), on free ports:
    (the process, its gRPC port, its HTTP port)."""
    grpc, http = _free_port(), _free_port()
    serve = (f"bucketserve serve --config {config} --ray-address auto "
             f"--grpc-port {grpc} --http-port {http}")
    service = subprocess.Popen([RAY, "exec", RECIPE, serve], env=env, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return service, grpc, http


def ray_env(home: Path) -> dict[str, str]:
    """The environment of the `ray` CLI: `home` as HOME with a fresh Ray auth token (this
    machine's ~/.ray is left alone), the fake multi-node provider on, converted models from
    the usual cache."""
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return env | {"HOME": str(home), "PATH": f"{Path(RAY).parent}:{env['PATH']}",
                  "RAY_FAKE_CLUSTER": "1", "RAY_USAGE_STATS_ENABLED": "0",
                  CACHE_ENV: os.environ.get(CACHE_ENV, str(cache_root().parent))}


def _first_answer(target: str, deadline: float, service: subprocess.Popen) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=8)
    while True:
        if service.poll() is not None:
            raise RuntimeError(f"the service exited ({service.returncode}) before answering")
        try:
            with Client(target) as client:
                client.generate("Hello", greedy)
            return
        except Exception:
            if time.perf_counter() > deadline:
                raise
            time.sleep(0.25)


def _ray(env: dict[str, str], *args: str) -> None:
    subprocess.run([RAY, *args], env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=600)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="s to the first answer")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bs-rayup-home"))
    runs = []
    try:
        env = ray_env(home)
        for i in range(args.runs):
            runs.append(one_run(env, args.timeout))
            print(f"run {i + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[-1].items()),
                  flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print("median: " + ", ".join(f"{k} {v:.1f}" for k, v in median.items()))
    out: dict[str, Any] = {"command": " ".join(shlex.quote(a) for a in sys.argv),
                           "cpus": os.cpu_count(), "runs": runs, "median": median}
    if args.out:
        write_json(out, args.out)


if __name__ == "__main__":
    main()
