"""`bucketserve generate "prompt"` and `bucketserve chat` (`serve` is bucketserve.deploy.cli's)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from bucketserve import envs
from bucketserve.gateway.client_base import API_KEY_ENV, DEFAULT_TARGET

TARGET_ENV = "BUCKETSERVE_TARGET"


def register(subparsers: Any) -> None:
    generate = subparsers.add_parser(
        "generate", help="stream a completion of PROMPT from a running server"
    )
    generate.add_argument("prompt", metavar="PROMPT")
    generate.add_argument(
        "--chat", action="store_true", help="send PROMPT as a user message (chat template)"
    )
    _client_args(generate, max_tokens=128)
    generate.add_argument(
        "--n", type=int, default=1, help="samples of the prompt, each printed whole (1..16)"
    )
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
        default=envs.BUCKETSERVE_TARGET or DEFAULT_TARGET,
        help=f"server host:port (${TARGET_ENV} or {DEFAULT_TARGET})",
    )
    parser.add_argument("--api-key", help=f"tenant key (default ${API_KEY_ENV})")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2]")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2]")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="(0, 2]")
    parser.add_argument("--min-p", type=float, default=0.0, help="[0, 1]")
    parser.add_argument(
        "--min-tokens", type=int, default=0, help="no EOS or stop token before this many"
    )
    parser.add_argument(
        "--logprobs",
        type=int,
        help="print each token's logprob and its top K alternatives after the text (0..20)",
    )
    parser.add_argument("--timeout", type=float, help="seconds before the call is abandoned")
    parser.add_argument("--tls", action="store_true", help="connect with TLS")


def run_generate(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from bucketserve.gateway.errors import BucketServeError

    out = out or sys.stdout
    messages = [{"role": "user", "content": args.prompt}] if args.chat else None
    try:
        params = _params(args)
        with _client(args) as client:
            if params.n > 1:
                done = (
                    client.chat(messages, params, timeout=args.timeout)
                    if messages
                    else client.generate(args.prompt, params, timeout=args.timeout)
                )
                _print_samples(done, out)
                return 0
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
    from bucketserve.gateway.errors import BucketServeError

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
    from bucketserve.gateway.errors import InvalidArgumentError
    from bucketserve.runtime.core.sampling_params import SamplingParams

    try:
        return SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            stop=args.stop,
            seed=args.seed,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
            min_p=args.min_p,
            min_tokens=args.min_tokens,
            logprobs=args.logprobs,
            n=getattr(args, "n", 1),
        )
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from exc


def _client(args: argparse.Namespace) -> Any:
    from bucketserve.gateway.client import Client

    return Client(args.target, api_key=args.api_key, secure=args.tls)


def _print_stream(chunks: Any, out: TextIO) -> str:
    """Writes each chunk's text as it comes; returns the whole text."""
    from bucketserve.gateway.errors import GenerationError

    text = ""
    tokens: list[tuple[int, Any]] = []
    for chunk in chunks:
        out.write(chunk.text)
        out.flush()
        text += chunk.text
        if chunk.logprobs is not None:
            tokens += zip(chunk.token_ids, chunk.logprobs, strict=False)
        if chunk.finished:
            out.write("\n")
            if chunk.finish_reason == "error":
                raise GenerationError(f"generation failed: {chunk.error}")
    for token_id, lp in tokens:
        if lp is None:
            out.write(f"{token_id}\t?\n")
            continue
        top = " ".join(f"{t}:{v:.4f}" for t, v in lp.top)
        out.write(f"{token_id}\t{lp.logprob:.4f}" + (f"\t{top}" if top else "") + "\n")
    return text


def _print_samples(done: Any, out: TextIO) -> None:
    """Each sample's whole text under a `[i]` header line."""
    for sample in done.choices:
        out.write(f"[{sample.index}] ({sample.finish_reason})\n{sample.text}\n")


def _fail(command: str, exc: Any) -> int:
    print(f"bucketserve {command}: {exc.code.name}: {exc}", file=sys.stderr)
    return 1
