"""The peer comparison's workloads and bookkeeping (benchmarks/peers), without running a
benchmark: what each server is started with, what `vllm bench serve` is asked to send,
the multi-turn and shared-prefix prompt sets, the prefix-cache counters read from
`/metrics`, and the offline workers' reset before every timed run."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.peers import harness, served, served_workloads, structured
from benchmarks.peers.conversations import ConversationSpec, conversation_prompts
from benchmarks.peers.offline import prefix_workload

REPO = Path(__file__).resolve().parents[2]
PEER_VENV = Path(os.environ.get("BUCKETSERVE_PEERS_VENV") or REPO / "benchmarks/peers/.venv")


def served_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    served_workloads.add_workload_args(parser)
    served.add_server_args(parser)
    args = parser.parse_args(list(argv))
    served_workloads.resolve(args, parser)
    args.seed = 0
    return args


class Launched:
    """Stands in for `served.Server`: keeps what a server would have been started with."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int) -> None:
        self.name, self.argv, self.env, self.port = name, argv, env, port


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(served, "Server", Launched)


@pytest.mark.usefixtures("launched")
@pytest.mark.parametrize("caching", [True, False])
def test_vllm_serves_with_its_default_prefix_caching_and_can_reset(caching: bool) -> None:
    args = served_args(*([] if caching else ["--no-prefix-caching"]))
    server = served._start("vllm", Path("/model"), args)
    assert ("--no-enable-prefix-caching" in server.argv) is not caching
    assert server.env["VLLM_SERVER_DEV_MODE"] == "1"  # POST /reset_prefix_cache


@pytest.mark.usefixtures("launched")
@pytest.mark.parametrize("caching", [True, False])
def test_bucketserve_config_keeps_or_turns_off_prefix_caching(caching: bool) -> None:
    from bucketserve.deploy.serve_config import ServeConfig

    args = served_args(*([] if caching else ["--no-prefix-caching"]))
    server = served._start("bucketserve-colocated-local", Path("/model"), args)
    assert "VLLM_SERVER_DEV_MODE" not in server.env
    config = ServeConfig.load(server.argv[server.argv.index("--config") + 1])
    assert config.controller.runner.enable_prefix_caching is caching
    assert config.controller.topology == "colocated"
    assert config.controller.mode == "local"


def test_workload_defaults() -> None:
    random = served_args()
    assert (random.rates, random.num_prompts, random.output_len) == ("1,2,3,4", 100, 96)
    prefix = served_args("--workload", "prefix")
    assert (prefix.num_prompts, prefix.output_len, prefix.num_prefixes) == (40, 64, 4)
    assert (prefix.prefix_len, prefix.suffix_len) == (768, 48)
    turns = served_args("--workload", "multiturn", "--conversations", "3", "--turns", "4")
    assert turns.num_prompts == 12
    assert served_args("--workload", "prefix", "--rates", "1", "--output-len", "8").rates == "1"


@pytest.mark.parametrize("argv", [
    ["--workload", "prefix", "--num-prompts", "42"],  # not a multiple of 4 prefixes
    ["--workload", "multiturn", "--num-prompts", "40"],  # 8 x 6 turns
])
def test_workload_sizes_that_do_not_fit_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        served_args(*argv)


def bench_argv(args: argparse.Namespace, dataset: Path | None = None) -> list[str]:
    server = Launched("vllm", [], {}, 8000)
    return served.bench_argv(server, Path("/model"), 1.5, args, Path("/out"), "run.json", dataset)


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_bench_argv_per_workload() -> None:
    random = bench_argv(served_args())
    assert option(random, "--dataset-name") == "random"
    assert option(random, "--endpoint") == "/v1/chat/completions"
    assert option(random, "--random-output-len") == "96"

    prefix = bench_argv(served_args("--workload", "prefix"))
    assert option(prefix, "--dataset-name") == "prefix_repetition"
    assert option(prefix, "--prefix-repetition-num-prefixes") == "4"
    assert option(prefix, "--prefix-repetition-prefix-len") == "768"
    assert option(prefix, "--prefix-repetition-suffix-len") == "48"
    assert option(prefix, "--prefix-repetition-output-len") == "64"
    assert option(prefix, "--num-prompts") == "40"

    turns = bench_argv(served_args("--workload", "multiturn"), Path("/out/multiturn-s0.jsonl"))
    assert option(turns, "--dataset-name") == "custom"
    assert option(turns, "--endpoint") == "/v1/completions"
    assert option(turns, "--dataset-path") == "/out/multiturn-s0.jsonl"
    assert {"--skip-chat-template", "--disable-shuffle"} <= set(turns)
    assert option(turns, "--custom-output-len") == "64"
    assert option(turns, "--num-prompts") == "48"
    for argv in (random, prefix, turns):
        assert "--ignore-eos" in argv and option(argv, "--request-rate") == "1.5"
    with pytest.raises(ValueError):
        bench_argv(served_args("--workload", "multiturn"))


TICKET = {"customer": {"name": "Ann", "email": "ann@example.com", "plan": "pro"},
          "category": "bug", "priority": "low", "summary": "It crashes.",
          "items": [{"product": "app", "quantity": 1}], "refund_requested": False}


@pytest.mark.usefixtures("launched")
def test_structured_workload_sends_its_schema_to_llguidance_on_both_servers(
    tmp_path: Path,
) -> None:
    args = served_args("--workload", "structured")
    assert (args.rates, args.num_prompts, args.output_len) == ("0.25,0.5,0.75,1", 40, 256)
    path = served_workloads.prepare(args, Path("/m"), tmp_path)
    rows = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
    assert sorted(rows) == sorted((structured.prompts() * 7)[:40])
    assert rows == [json.loads(line)["prompt"] for line in
                    served_workloads.prepare(args, Path("/m"), tmp_path).read_text().splitlines()]
    argv = bench_argv(args, path)
    assert option(argv, "--dataset-name") == "custom"
    assert option(argv, "--endpoint") == "/v1/chat/completions"
    assert option(argv, "--custom-output-len") == "256"
    assert json.loads(option(argv, "--extra-body"))["response_format"]["json_schema"][
        "schema"] == structured.SCHEMA
    assert "--ignore-eos" not in argv  # the grammar ends the reply
    assert option(argv, "--temperature") == "0"
    assert option(bench_argv(served_args("--workload", "structured", "--temperature", "0.7"),
                             path), "--temperature") == "0.7"
    vllm = served._start("vllm", Path("/model"), args).argv
    assert json.loads(option(vllm, "--structured-outputs-config")) == {"backend": "guidance"}
    assert "--structured-outputs-config" not in served._start(
        "vllm", Path("/model"), served_args()).argv


def test_structured_runs_report_the_share_of_replies_that_validate() -> None:
    good, cut = json.dumps(TICKET), json.dumps(TICKET)[:40]
    wrong = json.dumps({**TICKET, "priority": "whenever"})
    assert structured.valid_fraction([good, cut, wrong, good, ""], ["", "", "", "", "503"],
                                     total=5) == 0.4
    args = served_args("--workload", "structured")
    raw = {"completed": 2, "num_prompts": 2, "output_throughput": 10.0, "p50_ttft_ms": 100.0,
           "p90_ttft_ms": 300.0, "p50_tpot_ms": 20.0, "p90_tpot_ms": 40.0,
           "ttfts": [0.1, 0.2], "itls": [[0.02], [0.02]], "errors": ["", ""],
           "generated_texts": [good, cut]}
    raw["schema_valid"] = served_workloads.schema_valid(args, raw)
    assert served.summarize(raw, 1.0, 4.0, 0.25)["schema_valid"] == 0.5
    assert served_workloads.schema_valid(served_args(), raw) is None


@pytest.fixture(scope="module")
def tokenizer(smollm_tokenizer_dir: Path) -> Any:
    from bucketserve.runtime.io.tokenizer import Tokenizer

    return Tokenizer.from_dir(smollm_tokenizer_dir)


def test_every_turn_resends_the_previous_turn_whole(tokenizer: Any) -> None:
    spec = ConversationSpec(num_conversations=3, num_turns=4, user_len=24, reply_len=16)
    prompts = conversation_prompts(tokenizer, spec, seed=1)
    assert len(prompts) == spec.num_requests == 12
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    for turn in range(1, spec.num_turns):
        for c in range(spec.num_conversations):
            before, now = ids[(turn - 1) * 3 + c], ids[turn * 3 + c]
            assert now[: len(before)] == before  # the whole earlier prompt, token for token
            assert len(now) - len(before) >= spec.user_len + spec.reply_len
            assert f"[conversation {c}, turn {turn + 1}]" in prompts[turn * 3 + c]
    first_turns = [p.split("<|im_start|>user\n", 1)[1] for p in prompts[:3]]
    assert len(set(first_turns)) == 3
    assert conversation_prompts(tokenizer, spec, seed=1) == prompts


def test_multiturn_dataset_file(tokenizer: Any, tmp_path: Path, smollm_tokenizer_dir: Path
                                ) -> None:
    args = served_args("--workload", "multiturn", "--conversations", "2", "--turns", "3",
                       "--user-len", "16", "--output-len", "8")
    path = served_workloads.prepare(args, smollm_tokenizer_dir, tmp_path)
    assert path == tmp_path / "multiturn-s0.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == conversation_prompts(
        tokenizer, ConversationSpec(2, 3, 16, 8), seed=0
    )
    assert served_workloads.prepare(served_args("--workload", "prefix"), Path("/m"), tmp_path) \
        is None


VLLM_METRICS = """\
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 32640.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 27648.0
vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 99.0
"""
BUCKETSERVE_METRICS = """\
bucketserve:prefix_cache_hit_rate{role="decode",worker="decode-0"} 0.5
bucketserve:prefix_cache_queries_total 100.0
bucketserve:prefix_cache_hits_total 50.0
"""


def test_prefix_cache_counters_of_either_server() -> None:
    assert served.prefix_cache_counts(VLLM_METRICS) == (32640.0, 27648.0)
    assert served.prefix_cache_counts(BUCKETSERVE_METRICS) == (100.0, 50.0)
    assert served.prefix_cache_counts("vllm:num_requests_running 0.0\n") is None
    assert served.hit_rate((100.0, 50.0), (300.0, 200.0)) == 0.75
    assert math.isnan(served.hit_rate(None, (300.0, 200.0)))
    assert math.isnan(served.hit_rate((100.0, 50.0), (100.0, 50.0)))


def test_summary_carries_the_hit_rate_and_medians_skip_missing_ones() -> None:
    raw = {"completed": 2, "num_prompts": 2, "output_throughput": 10.0, "p50_ttft_ms": 100.0,
           "p90_ttft_ms": 300.0, "p50_tpot_ms": 20.0, "p90_tpot_ms": 40.0,
           "ttfts": [0.1, 5.0], "itls": [[0.02], [0.02]], "errors": ["", ""],
           "prefix_cache_hit_rate": 0.9}
    row = served.summarize(raw, 1.0, slo_ttft=4.0, slo_tpot=0.25)
    assert (row["prefix_cache_hit_rate"], row["slo_attainment"], row["failed"]) == (0.9, 0.5, 0)
    unknown = served.summarize({**raw, "prefix_cache_hit_rate": math.nan}, 1.0, 4.0, 0.25)
    other = served.summarize({**raw, "prefix_cache_hit_rate": 0.7}, 1.0, 4.0, 0.25)
    [median] = served._medians([[row], [unknown], [other]])
    assert median["prefix_cache_hit_rate"] == pytest.approx(0.8)
    assert math.isnan(served._medians([[unknown]])[0]["prefix_cache_hit_rate"])


def test_offline_prefix_prompts_share_their_prefixes() -> None:
    w = prefix_workload(vocab_size=1000, num_prompts=12, num_prefixes=3, prefix_len=40,
                        suffix_len=5, seed=0)
    assert (w.name, w.metric, w.max_tokens, w.ceiling) == ("prefix", "prompt", 1, False)
    assert all(len(p) == 45 for p in w.prompts)
    prefixes = [tuple(p[:40]) for p in w.prompts]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]
    assert len({tuple(p[40:]) for p in w.prompts}) == 12
    assert all(256 <= t < 1000 for p in w.prompts for t in p)
    assert w.prompts == prefix_workload(1000, 12, 3, 40, 5, seed=0).prompts
    with pytest.raises(ValueError):
        prefix_workload(1000, 2, 3, 40, 5)


def test_offline_worker_resets_its_prefix_cache_before_every_timed_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []

    def load(spec: dict[str, Any]) -> tuple[Any, Any, str]:
        def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
            calls.append(f"generate {max_tokens}")
            return [[1] * max_tokens for _ in prompts]

        return generate, lambda: calls.append("reset"), "fake"

    commands = [{"prompts": [[5, 6]], "max_tokens": n} for n in (3, 4)]
    monkeypatch.setattr(sys, "argv", ["worker", json.dumps({"warmup_prompts": [[5]]})])
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(json.dumps(c) + "\n"
                                                          for c in commands)))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    harness.serve_engine(load)
    assert calls == ["generate 8", "reset", "generate 3", "reset", "generate 4"]
    answers = [json.loads(line.removeprefix(harness.RESULT_MARK))
               for line in out.getvalue().splitlines()]
    assert answers[0]["version"] == "fake"
    assert [a["token_ids"] for a in answers[1:]] == [[[1, 1, 1]], [[1, 1, 1, 1]]]


CHECK_IN_PEER_VENV = """
import json, sys
from vllm.benchmarks.datasets import CustomDataset
from vllm.benchmarks.serve import add_cli_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
from transformers import AutoTokenizer

runs, jsonl, tokenizer_dir = json.loads(sys.argv[1])
parser = FlexibleArgumentParser()
add_cli_args(parser)
for argv in runs:
    parser.parse_args(argv)  # exits on an option this vLLM does not take
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
data = CustomDataset(dataset_path=jsonl, disable_shuffle=True, random_seed=0)
samples = data.sample(tokenizer=tokenizer, num_requests=6, output_len=8,
                      skip_chat_template=True)
print(json.dumps([s.prompt for s in samples]))
"""


@pytest.mark.slow
def test_vllm_bench_serve_takes_every_workload(tmp_path: Path, tiny_model_dir: Path) -> None:
    """vLLM's own parser accepts each workload's options, and its custom dataset reads the
    multi-turn file back in order."""
    if not (PEER_VENV / "bin" / "python").is_file():
        pytest.skip(f"no vLLM venv at {PEER_VENV}: `bash benchmarks/peers/setup.sh` builds one")
    turns = served_args("--workload", "multiturn", "--conversations", "2", "--turns", "3",
                        "--user-len", "16", "--output-len", "8")
    jsonl = served_workloads.prepare(turns, tiny_model_dir, tmp_path)
    runs = [bench_argv(served_args(*a))[3:] for a in ([], ["--workload", "prefix"])]
    runs.append(bench_argv(turns, jsonl)[3:])
    ticket = served_args("--workload", "structured", "--num-prompts", "6")
    runs.append(bench_argv(ticket, served_workloads.prepare(ticket, tiny_model_dir, tmp_path))[3:])
    result = subprocess.run(
        [str(PEER_VENV / "bin" / "python"), "-c", CHECK_IN_PEER_VENV,
         json.dumps([runs, str(jsonl), str(tiny_model_dir)])],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    sent = json.loads(result.stdout.strip().splitlines()[-1])
    assert sent == [json.loads(line)["prompt"] for line in jsonl.read_text().splitlines()]
