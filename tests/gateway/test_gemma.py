"""Gemma 3 270M, a base model without a chat template, through `bucketserve serve`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.gateway.conftest import http_post

PROMPT = "The capital of France is"


@pytest.mark.slow
@pytest.mark.gemma
def test_served_gemma_completes_like_transformers_and_refuses_chat(
    gemma_gguf: Path, gemma_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = {
        "gateway": {"grpc_port": 0, "http_port": 0},
        "kv_cache": {"num_blocks": 64},
        "controller": {"mode": "local"},
        "model": {"quantization": "none"},  # float32, as transformers computes
    }
    path, log = tmp_path / "service.yaml", tmp_path / "stderr.log"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "bucketserve.cli", "serve", "--config", str(path),
               "--model", str(gemma_gguf)]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    try:
        # transformers on the converted weights (equal to its own GGUF loader's:
        # test_gguf_gemma), while the service starts
        tok = AutoTokenizer.from_pretrained(gemma_dir)
        model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
        ids = tok(PROMPT, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            want = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
        del model
        http = re.search(r"HTTP\s+(\S+)", _read_banner(proc, log)).group(1)
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        status, completion, _ = http_post(f"{http}/v1/completions", body)
        assert status == 200, completion
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        status, refusal, _ = http_post(f"{http}/v1/chat/completions", chat)
        assert status == 400
        assert "no chat template" in refusal["error"]["message"]
        assert "--chat-template" in refusal["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert completion["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
    usage = completion["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (ids.shape[1], 12)


def _read_banner(proc: subprocess.Popen[str], log: Path) -> str:
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("Ctrl-C"):
            return "".join(lines)
    raise AssertionError(f"serve exited early: {log.read_text()}")
