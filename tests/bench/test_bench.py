"""One short real run of `bucketserve bench` against an in-process server over the tiny model,
through the gRPC SDK and through OpenAI SSE: every request is accounted for and the client's
token counts equal the server's usage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bucketserve.bench.bench import Bench
from bucketserve.bench.cli import build_config, run
from bucketserve.cli import build_parser
from tests.gateway.loop_thread import LoopThread

pytestmark = pytest.mark.slow


def bench_args(server: Any, tiny_model_dir: Path, out: Path, *extra: str) -> Any:
    argv = [
        "bench", "--target", server.grpc_target, "--base-url", f"{server.http_url}/v1",
        "--metrics-url", f"{server.http_url}/metrics", "--tokenizer", str(tiny_model_dir),
        "--workload", "mixed", "--long-fraction", "0.3", "--max-model-len", "256",
        "--output-mean", "8", "--output-max", "16", "--num-requests", "10",
        "--tenant", "chat:chat-key", "--tenant", "batch:batch-key@long",
        "--slo-ttft", "30", "--slo-tpot", "5", "--out", str(out), "--no-progress", *extra,
    ]
    return build_parser().parse_args(argv)


def check_records(bench: Bench, result: dict[str, Any]) -> None:
    requests = bench.make_workload(result["runs"][0]["rate"]).requests
    (records,) = bench.records.values()
    assert sorted(r.index for r in records) == list(range(len(requests)))
    for request, record in zip(requests, sorted(records, key=lambda r: r.index), strict=True):
        assert record.error is None, record.error
        assert record.finish_reason == "length"
        assert record.output_tokens == record.server_completion_tokens == request.max_tokens
        assert record.server_prompt_tokens == request.prompt_len
        assert record.ttft is not None and 0 < record.ttft <= record.e2e
    (run_result,) = result["runs"]
    summary, server = run_result["summary"], run_result["server"]
    assert summary["sent"] == summary["completed"] == len(requests)
    assert summary["slo_attainment"] == 1.0
    assert server["generation_tokens"] == sum(r.max_tokens for r in requests)
    assert server["prompt_tokens"] == sum(r.prompt_len for r in requests)


def test_grpc_open_loop_accounts_for_every_request(
    service: Any, loop_thread: LoopThread, tiny_model_dir: Path, tmp_path: Path
) -> None:
    controller, server = service
    config = build_config(bench_args(server, tiny_model_dir, tmp_path, "--rate", "20"))
    bench = Bench(config)
    result = bench.run()
    check_records(bench, result)
    assert {r.tenant for r in bench.make_workload(20.0).requests} == {"chat", "batch"}
    records = next(iter(bench.records.values()))
    assert all(r.request_bucket and r.shape_bucket for r in records)
    stats = loop_thread.run(controller.drain(30), timeout=40)
    assert all(w.num_free_blocks == w.num_total_blocks for w in stats.workers)


def test_openai_closed_loop_via_the_cli(
    service: Any, loop_thread: LoopThread, tiny_model_dir: Path, tmp_path: Path
) -> None:
    controller, server = service
    args = bench_args(server, tiny_model_dir, tmp_path, "--backend", "openai",
                      "--model", server.model_name, "--concurrency", "3", "--name", "oai")
    assert run(args) == 0
    result = json.loads((tmp_path / "oai.json").read_text())
    (run_result,) = result["runs"]
    assert run_result["concurrency"] == 3
    summary = run_result["summary"]
    assert summary["sent"] == summary["completed"] == 10 and summary["failed"] == 0
    workload = result["workload"]
    assert run_result["server"]["prompt_tokens"] == pytest.approx(workload["prompt_len_mean"] * 10)
    assert run_result["server"]["generation_tokens"] == pytest.approx(
        workload["output_len_mean"] * 10
    )
    assert (tmp_path / "oai" / "slo_attainment_and_served_rate.png").stat().st_size > 1000
    stats = loop_thread.run(controller.drain(30), timeout=40)
    assert all(w.num_free_blocks == w.num_total_blocks for w in stats.workers)


def test_openai_backend_counts_match_usage(
    service: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    _, server = service
    args = bench_args(server, tiny_model_dir, tmp_path, "--backend", "openai",
                      "--model", server.model_name, "--rate", "50")
    bench = Bench(build_config(args))
    check_records(bench, bench.run())


def test_bad_bench_arguments_exit_with_a_message(capsys: pytest.CaptureFixture) -> None:
    args = build_parser().parse_args(["bench", "--target", "192.0.2.1:50051", "--rate", "1"])
    assert run(args) == 2
    assert "--allow-remote" in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "--backend", "openai", "--rate", "1"])
    assert run(args) == 2
    assert "--model NAME" in capsys.readouterr().err
