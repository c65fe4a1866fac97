"""`bucketserve serve`, `bucketserve generate "prompt"` and `bucketserve chat`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from gateway.client_base import API_KEY_ENV, DEFAULT_TARGET
from gateway.gateway_config import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT
from gateway.log_setup import LEVELS, configure_logging

TARGET_ENV = "BUCKETSERVE_TARGET"


def register(subparsers: Any) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="start the service: gRPC API and OpenAI-compatible HTTP (embedded default model)",
        description="Start the service. With no --config: one prefill and one decode Ray "
        "actor on CPU serving the embedded SmolLM2, no API key needed. Flags override the "
        "config file. Ctrl-C or SIGTERM drains running requests, then stops.",
    )
    serve.add_argument("--config", type=Path, help="service YAML: gateway, tenants, controller")
    serve.add_argument("--grpc-port", type=int, help=f"gRPC port ({DEFAULT_GRPC_PORT})")
    serve.add_argument("--http-port", type=int, help=f"HTTP port ({DEFAULT_HTTP_PORT})")
    serve.add_argument("--host", help="address to bind (127.0.0.1; 0.0.0.0 for a network)")
    serve.add_argument("--model", help="HF model dir or .gguf file (default: embedded SmolLM2)")
    serve.add_argument("--ray-address", help="join this Ray cluster ('auto' finds it)")
    serve.add_argument(
        "--local", action="store_true", help="all workers in this process, without Ray"
    )
    serve.add_argument("--log-level", choices=LEVELS, default="info", help="(info)")
    serve.add_argument(
        "--log-json", action="store_true", help="log one JSON object per line (log shippers)"
    )
    serve.set_defaults(func=run_serve)

    generate = subparsers.add_parser(
        "generate", help="stream a completion of PROMPT from a running server"
    )
    generate.add_argument("prompt", metavar="PROMPT")
    generate.add_argument(
        "--chat", action="store_true", help="send PROMPT as a user message (chat template)"
    )
    _client_args(generate, max_tokens=128)
    generate.set_defaults(func=run_generate)

    chat = subparsers.add_parser(
        "chat", help="talk to a running server; the conversation is kept (/reset, /exit)"
    )
    chat.add_argument("--system", help="system message that starts the conversation")
    _client_args(chat, max_tokens=256)
    chat.set_defaults(func=run_chat)


def _client_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument(
        "--target",
        default=os.environ.get(TARGET_ENV, DEFAULT_TARGET),
        help=f"server host:port (${TARGET_ENV} or {DEFAULT_TARGET})",
    )
    parser.add_argument("--api-key", help=f"tenant key (default ${API_KEY_ENV})")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--timeout", type=float, help="seconds before the call is abandoned")
    parser.add_argument("--tls", action="store_true", help="connect with TLS")


def run_serve(args: argparse.Namespace) -> int:
    from gateway.service_runner import ServiceRunner

    configure_logging(args.log_level, args.log_json)
    try:
        runner = ServiceRunner.from_args(args)
    except ValueError as exc:
        print(f"bucketserve serve: {exc}", file=sys.stderr)
        return 2
    return runner.run()


def run_generate(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from gateway.errors import BucketServeError

    out = out or sys.stdout
    messages = [{"role": "user", "content": args.prompt}] if args.chat else None
    try:
        params = _params(args)
        with _client(args) as client:
            chunks = (
                client.chat_stream(messages, params, timeout=args.timeout)
                if messages
                else client.stream(args.prompt, params, timeout=args.timeout)
            )
            _print_stream(chunks, out)
    except BucketServeError as exc:
        return _fail("generate", exc)
    return 0


def run_chat(
    args: argparse.Namespace, stdin: TextIO | None = None, out: TextIO | None = None
) -> int:
    from gateway.errors import BucketServeError

    stdin, out = stdin or sys.stdin, out or sys.stdout
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    interactive = stdin.isatty()
    try:
        params = _params(args)
        with _client(args) as client:
            while True:
                if interactive:
                    out.write("> ")
                    out.flush()
                line = stdin.readline()
                if not line or line.strip() == "/exit":
                    return 0
                if line.strip() == "/reset":
                    messages = list(system)
                    continue
                if not line.strip():
                    continue
                messages.append({"role": "user", "content": line.rstrip("\n")})
                chunks = client.chat_stream(messages, params, timeout=args.timeout)
                messages.append({"role": "assistant", "content": _print_stream(chunks, out)})
    except BucketServeError as exc:
        return _fail("chat", exc)


def _params(args: argparse.Namespace) -> Any:
    """SamplingParams from the flags; a bad value is an InvalidArgumentError."""
    from gateway.errors import InvalidArgumentError
    from runtime.sampling_params import SamplingParams

    try:
        return SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            stop=args.stop,
            seed=args.seed,
        )
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from exc


def _client(args: argparse.Namespace) -> Any:
    from gateway.client import Client

    return Client(args.target, api_key=args.api_key, secure=args.tls)


def _print_stream(chunks: Any, out: TextIO) -> str:
    """Writes each chunk's text as it comes; returns the whole text."""
    from gateway.errors import GenerationError

    text = ""
    for chunk in chunks:
        out.write(chunk.text)
        out.flush()
        text += chunk.text
        if chunk.finished:
            out.write("\n")
            if chunk.finish_reason == "error":
                raise GenerationError(f"generation failed: {chunk.error}")
    return text


def _fail(command: str, exc: Any) -> int:
    print(f"bucketserve {command}: {exc.code.name}: {exc}", file=sys.stderr)
    return 1
