"""The default deployment as a user starts it: `bucketserve serve` in a process of its own,
the embedded SmolLM2 in one colocated Ray actor on a local Ray it started. One service for
the module; the last test stops it with Ctrl-C (slow: minutes on a loaded 2-core box)."""

from __future__ import annotations

import ipaddress
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from benchmarks.serve_process import ServeProcess
from bucketserve import Client, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.smollm]

PROMPT = "Once upon a time"
TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
# what a user runs, less fixed ports (tests share the machine), with a short drain, and
# float32 weights: a killed worker's requests are prefilled again with what they streamed,
# and only float32 promises the fault-free text to the token after such a re-prefill (with
# the GGUF's blocks kept, x in 8 bits can tip a near tie, as in llama.cpp)
CONFIG = {
    "gateway": {"grpc_port": 0, "http_port": 0, "drain_timeout_s": 1.0},
    "model": {"quantization": "none"},
}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    served = ServeProcess.start(CONFIG, tmp_path_factory.mktemp("default_serve"), env=env)
    try:
        yield served
    finally:
        served.close()


@pytest.fixture(scope="module")
def reference(service: ServeProcess) -> str:
    """The greedy text of PROMPT, fault-free."""
    with Client(service.grpc_target) as client:
        return client.generate(PROMPT, GREEDY).text


def oai(service: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.http_url}/v1", api_key="none", max_retries=0)


def test_http_and_grpc_answer_alike_through_a_ray_actor_and_only_loopback_listens(
    service: ServeProcess, reference: str
) -> None:
    assert list(service.workers().values()) == ["ray::DecodeWorker"]  # one colocated actor
    http = oai(service).completions.create(
        model=service.model_name, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert http.choices[0].text == reference and http.usage.completion_tokens == TOKENS
    wide = []
    for process in service.tree():
        try:
            connections = process.net_connections(kind="inet")
        except psutil.Error:
            continue
        wide += [
            (process.pid, " ".join(process.cmdline())[:60], c.laddr)
            for c in connections
            if c.status == psutil.CONN_LISTEN and not _loopback(c.laddr.ip)
        ]
    assert wide == []
    assert "listening beyond loopback" not in service.log.read_text()
    assert (Path.home() / ".ray" / "auth_token").stat().st_mode & 0o077 == 0  # Ray's key


def test_a_worker_killed_mid_stream_loses_nothing(
    service: ServeProcess, reference: str
) -> None:
    """SIGKILL to the only worker's process while a gRPC and an HTTP stream run: Ray brings
    the actor back, both requests are prefilled again with what they streamed, and both
    end with the fault-free text; every KV block is free after."""
    (victim,) = service.wait_for_workers()
    http_text: list[str] = []
    http_errors: list[Exception] = []
    http_started = threading.Event()

    def http_stream() -> None:
        try:
            for chunk in oai(service).completions.create(
                model=service.model_name, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            ):
                http_started.set()
                http_text.extend(c.text for c in chunk.choices)
        except Exception as exc:  # reported with the service's log below
            http_errors.append(exc)

    thread = threading.Thread(target=http_stream)
    thread.start()
    chunks, killed = [], False
    with service.explained(), Client(service.grpc_target) as client:
        for chunk in client.stream(PROMPT, GREEDY):
            chunks.append(chunk)
            streamed = sum(len(c.token_ids) for c in chunks)
            if not killed and streamed >= 4 and http_started.wait(300):
                os.kill(victim, signal.SIGKILL)
                killed = True
    thread.join(timeout=600)
    assert not http_errors, f"{http_errors[0]!r}\n{service.report()}"
    assert killed and not thread.is_alive()
    assert chunks[-1].finish_reason == "length" and chunks[-1].error is None
    assert "".join(c.text for c in chunks) == reference
    assert "".join(http_text) == reference
    assert service.wait_for_workers(exclude={victim})  # the actor's new process
    assert _kv_usage_settles_at_zero(service)


def test_ctrl_c_cancels_what_runs_and_leaves_no_process(service: ServeProcess) -> None:
    """Ctrl-C (SIGINT to the process group, as a terminal sends it): a running stream gets
    its final message, the service exits 0, and none of its processes (Ray's GCS, raylet,
    agents, workers) outlives it."""
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with service.explained(), Client(service.grpc_target) as client:
        stream = client.stream(PROMPT, long)
        next(stream)
        result: list[int] = []
        stopper = threading.Thread(target=lambda: result.append(service.interrupt()))
        stopper.start()
        final = list(stream)[-1]
        stopper.join(timeout=300)
    assert (final.finish_reason, final.error) == ("cancelled", "the server is shutting down")
    assert result == [0]
    assert service.leftovers() == []


def _loopback(host: str) -> bool:
    address = ipaddress.ip_address(host.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _kv_usage_settles_at_zero(service: ServeProcess, timeout_s: float = 120.0) -> bool:
    """The decode workers' KV blocks in use on /metrics reach 0 (within `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{service.http_url}/metrics", timeout=30) as response:
            lines = response.read().decode().splitlines()
        used = [
            float(line.rsplit(" ", 1)[1]) for line in lines
            if line.startswith("bucketserve:kv_cache_blocks_used{") and 'role="decode"' in line
        ]
        if used and all(u == 0 for u in used):
            return True
        time.sleep(0.5)
    return False
