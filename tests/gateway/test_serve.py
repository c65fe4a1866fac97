"""`bucketserve serve` as a real process: banner, tenants from --config, drain on SIGINT."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bucketserve import AuthenticationError, Client, SamplingParams

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.mark.slow
def test_serve_prints_how_to_call_it_and_drains_on_sigint(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = {
        "gateway": {"grpc_port": 0, "http_port": 0, "drain_timeout_s": 0.05},
        "tenants": [{"name": "alice", "api_keys": ["alice-key"]}],
        "model": {"path": str(tiny_model_dir)},
        "kv_cache": {"block_size": 4, "num_blocks": 256},
        "controller": {"mode": "local"},
    }
    path, log = tmp_path / "service.yaml", tmp_path / "stderr.log"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "bucketserve.cli", "serve", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    try:
        banner = _read_banner(proc, log)
        target = re.search(r"gRPC\s+(\S+)", banner).group(1)
        http = re.search(r"HTTP\s+(\S+)", banner).group(1)
        assert f"bucketserve generate \"Once upon a time\" --target {target}" in banner
        assert f"curl {http}/v1/completions" in banner and "Authorization: Bearer" in banner
        assert f'OpenAI(base_url="{http}/v1"' in banner
        with Client(target, api_key="alice-key") as alice:
            assert alice.generate("Hi", SamplingParams(max_tokens=3)).completion_tokens == 3
            with Client(target, api_key="") as nobody, pytest.raises(AuthenticationError):
                nobody.generate("Hi")
            stream = alice.stream("Tell me a long story", LONG)
            next(stream)
            proc.send_signal(signal.SIGINT)
            final = list(stream)[-1]
        assert (final.finish_reason, final.error) == ("cancelled", "the server is shutting down")
        assert proc.wait(timeout=60) == 0
        assert "stopped: 0 running requests finished, 1 cancelled" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _read_banner(proc: subprocess.Popen[str], log: Path) -> str:
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("Ctrl-C"):
            return "".join(lines)
    raise AssertionError(f"serve exited early: {log.read_text()}")
