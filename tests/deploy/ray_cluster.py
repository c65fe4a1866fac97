"""What the cluster tests share: where Ray put each actor, the gRPC target a `serve`
prints, the reference output, a free port."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

from bucketserve import Client, SamplingParams
from bucketserve.runtime.engine.llm import LLM

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


def placement(env: dict[str, str]) -> dict[str, Any]:
    """{"actors": [[class name, node id], ...], "nodes": {node id: [resource names]}}."""
    probe = subprocess.run([sys.executable, "-c", PLACEMENT_PROBE], env=env,
                           capture_output=True, text=True, timeout=120, check=True)
    return json.loads(probe.stdout.strip().splitlines()[-1])


def grpc_target(proc: subprocess.Popen[str], log: Path) -> str:
    """The target of the banner `serve` prints once it serves."""
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"gRPC\s+(\S+)", line)
        if match:
            return match.group(1)
    raise AssertionError(f"serve exited before serving: {log.read_text()[-3000:]}")


def assert_greedy_matches_in_process(target: str, model_dir: Path) -> None:
    """Greedy output through the SDK equals the in-process engine's, ids and text."""
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=64)
    want = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with Client(target) as client:
        got = [client.generate(p, GREEDY) for p in PROMPTS]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.text for g in got] == [w.text for w in want]


def ctrl_c(proc: subprocess.Popen[str], service: list[psutil.Process] | None = None) -> None:
    """SIGINT to `service` (default: `proc` itself), which drains; `proc` must exit 0. Killed
    if it does not."""
    try:
        for target in service if service is not None else [proc]:
            target.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
