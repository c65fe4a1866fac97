"""`bucketserve generate` and `bucketserve chat` against a running server."""

from __future__ import annotations

import io
from typing import Any

import pytest

from bucketserve import Client, SamplingParams
from bucketserve.cli import build_parser, main

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def cli_args(server: Any, *extra: str) -> list[str]:
    return ["--target", server.grpc_target, "--temperature", "0", "--max-tokens", "8", *extra]


def test_generate_streams_the_completion_to_the_terminal(
    open_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    with Client(open_server.grpc_target) as client:
        want = client.generate("Once upon a time", GREEDY).text
        want_chat = client.chat([{"role": "user", "content": "Hi"}], GREEDY).text
    assert main(["generate", "Once upon a time", *cli_args(open_server)]) == 0
    assert capsys.readouterr().out == want + "\n"
    assert main(["generate", "Hi", "--chat", *cli_args(open_server)]) == 0
    assert capsys.readouterr().out == want_chat + "\n"


def test_generate_takes_the_sampling_flags(
    open_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=8, frequency_penalty=1.5, presence_penalty=0.5,
        repetition_penalty=1.2, min_p=0.1, min_tokens=3, logprobs=2,
    )
    with Client(open_server.grpc_target) as client:
        want = client.generate("Once upon a time", params)
    flags = ["--frequency-penalty", "1.5", "--presence-penalty", "0.5", "--repetition-penalty",
             "1.2", "--min-p", "0.1", "--min-tokens", "3", "--logprobs", "2"]
    assert main(["generate", "Once upon a time", *cli_args(open_server, *flags)]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert "\n".join(lines[: want.text.count("\n") + 1]) == want.text
    table = [line.split("\t") for line in lines[want.text.count("\n") + 1 :] if line]
    assert [int(row[0]) for row in table] == want.token_ids
    assert want.logprobs is not None
    for row, lp in zip(table, want.logprobs, strict=True):
        assert float(row[1]) == pytest.approx(lp.logprob, abs=1e-4)
        assert len(row[2].split()) == 2
    assert main(["generate", "Hi", *cli_args(open_server, "--min-p", "2")]) == 1
    assert "min_p must be in [0, 1], got 2.0" in capsys.readouterr().err


def test_generate_reports_errors_with_their_status(
    tenant_server: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BUCKETSERVE_API_KEY", raising=False)
    assert main(["generate", "Hi", *cli_args(tenant_server)]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("BUCKETSERVE_API_KEY", "alice-key")
    assert main(["generate", "Hi", *cli_args(tenant_server)]) == 0
    assert main(["generate", "Hi", *cli_args(tenant_server), "--api-key", "nope"]) == 1
    assert main(["generate", "Hi", *cli_args(tenant_server), "--top-p", "0"]) == 1
    assert "top_p must be in (0, 1]" in capsys.readouterr().err


def test_chat_keeps_the_conversation(open_server: Any) -> None:
    args = build_parser().parse_args(["chat", *cli_args(open_server), "--system", "Be brief."])
    out = io.StringIO()
    stdin = io.StringIO("Hi\n\nWhat is 2 + 2?\n/exit\n")
    assert args.func(args, stdin=stdin, out=out) == 0
    first, second = out.getvalue().splitlines()
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with Client(open_server.grpc_target) as client:
        assert client.chat(conversation, GREEDY).text == first
        conversation += [
            {"role": "assistant", "content": first},
            {"role": "user", "content": "What is 2 + 2?"},
        ]
        assert client.chat(conversation, GREEDY).text == second


def test_chat_reset_forgets_the_conversation(open_server: Any) -> None:
    args = build_parser().parse_args(["chat", *cli_args(open_server)])
    out = io.StringIO()
    assert args.func(args, stdin=io.StringIO("Hi\n/reset\nHi\n"), out=out) == 0
    first, second = out.getvalue().splitlines()
    assert first == second


def test_serve_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--config", "--grpc-port", "--http-port", "--host", "--model", "--ray-address"):
        assert flag in text
