"""`bucketserve serve --ray-address auto` joins a running two-node Ray cluster (slow)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from bucketserve import Client, SamplingParams
from runtime.llm import LLM

GREEDY = SamplingParams(temperature=0, max_tokens=10)
PROMPTS = ["Hello, my name is", "The capital of France is a city where"]
RAY = str(Path(sys.executable).with_name("ray"))
# Run in a driver of its own (the test process never joins the cluster): which node each
# live actor class sits on, and which custom resources each node has.
PLACEMENT_PROBE = """
import json, ray
from ray._private.state import actors
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
print(json.dumps({
    "actors": [[a["ActorClassName"], a["Address"]["NodeID"]]
               for a in actors().values() if a["State"] == "ALIVE"],
    "nodes": {n["NodeID"]: sorted(n["Resources"]) for n in ray.nodes() if n["Alive"]},
}))
"""


@pytest.fixture
def ray_cluster() -> Iterator[dict[str, str]]:
    """A head with `HPU: 1, prefill_node: 1` and a second node with `HPU: 1, decode_node: 1`,
    on this machine, in a temp dir of their own; the env that reaches it. Stopped by ending
    exactly the processes that run from that temp dir (`ray stop` would end every Ray
    instance of this user on the machine)."""
    temp_dir = tempfile.mkdtemp(prefix="bsray", dir="/tmp")  # short: unix socket paths
    port = _free_port()
    env = {
        **os.environ,
        "RAY_ADDRESS": f"127.0.0.1:{port}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    common = ["--num-cpus=2", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    try:
        _ray(env, "start", "--head", f"--port={port}", "--include-dashboard=false",
             "--dashboard-port=0", '--resources={"HPU": 1, "prefill_node": 1}', *common)
        _ray(env, "start", f"--address=127.0.0.1:{port}",
             '--resources={"HPU": 1, "decode_node": 1}', *common)
        yield env
    finally:
        _end_processes_under(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_serve_joins_the_cluster_and_places_workers_by_resources(
    ray_cluster: dict[str, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    pinned = {"accelerator": "hpu", "torch_threads": 1}
    config = {
        "model": {"path": str(tiny_model_dir)},
        "kv_cache": {"block_size": 4, "num_blocks": 128},
        "controller": {
            "prefill": {**pinned, "resources": {"prefill_node": 1}},
            "decode": {**pinned, "resources": {"decode_node": 1}},
        },
        "gateway": {"grpc_port": 0, "http_port": None, "drain_timeout_s": 1.0},
        "cluster": {"resources": {"HPU": 2}},
    }
    path, log = tmp_path / "serve.yaml", tmp_path / "serve.log"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "bucketserve.cli", "serve", "--config", str(path),
               "--ray-address", "auto"]
    with log.open("w") as err:
        proc = subprocess.Popen(command, env=ray_cluster, stdout=subprocess.PIPE, stderr=err,
                                text=True)
    try:
        target = _grpc_target(proc, log)
        llm = LLM(str(tiny_model_dir), block_size=4, num_kv_blocks=64)
        want = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        with Client(target) as client:
            got = [client.generate(p, GREEDY) for p in PROMPTS]
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert [g.text for g in got] == [w.text for w in want]

        probe = subprocess.run([sys.executable, "-c", PLACEMENT_PROBE], env=ray_cluster,
                               capture_output=True, text=True, timeout=120, check=True)
        placed = json.loads(probe.stdout.strip().splitlines()[-1])
        where = {cls: placed["nodes"][node] for cls, node in placed["actors"]}
        assert sorted(where) == ["DecodeWorker", "PrefillWorker"]
        assert "prefill_node" in where["PrefillWorker"]
        assert "decode_node" in where["DecodeWorker"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _grpc_target(proc: subprocess.Popen[str], log: Path) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"gRPC\s+(\S+)", line)
        if match:
            return match.group(1)
    raise AssertionError(f"serve exited before serving: {log.read_text()[-3000:]}")


def _ray(env: dict[str, str], *args: str) -> None:
    done = subprocess.run([RAY, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"ray {args[0]} failed: {done.stderr[-2000:]}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _end_processes_under(temp_dir: str) -> None:
    """SIGTERM, then SIGKILL, every process whose command line names `temp_dir`."""
    mine = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in proc.info["cmdline"] or ()):
                mine.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for proc in mine:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(mine, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
