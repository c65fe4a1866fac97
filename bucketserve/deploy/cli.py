"""`bucketserve serve` (the service from a config file and flags) and `bucketserve config
check FILE` (validate a service config without starting anything)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from bucketserve.gateway.gateway_config import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, BindError
from bucketserve.gateway.log_setup import LEVELS, configure_logging


def register(subparsers: Any) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="start the service: gRPC API and OpenAI-compatible HTTP (embedded default model)",
        description="Start the service. With no --config: one colocated Ray worker actor "
        "(prefill chunked into its decode steps) on CPU serving the embedded SmolLM2, no API "
        "key needed. Flags override the "
        "config file. Ctrl-C or SIGTERM drains running requests, then stops.",
    )
    serve.add_argument("--config", type=Path, help="service YAML: gateway, tenants, controller")
    serve.add_argument("--grpc-port", type=int, help=f"gRPC port ({DEFAULT_GRPC_PORT})")
    serve.add_argument("--http-port", type=int, help=f"HTTP port ({DEFAULT_HTTP_PORT})")
    serve.add_argument("--host", help="address to bind (127.0.0.1; 0.0.0.0 for a network)")
    serve.add_argument("--model", help="HF model dir or .gguf file (default: embedded SmolLM2)")
    serve.add_argument(
        "--quantization",
        choices=["auto", "none"],
        help="auto: a GGUF's quantized weights stay in their blocks on CPU (default); none: "
        "expand every weight to float32",
    )
    serve.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template for chat requests (default: the model's own; a base model "
        "has none)",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        help="read tool calls out of the model's text for tool_choice auto (default: none)",
    )
    serve.add_argument("--ray-address", help="join this Ray cluster ('auto' finds it)")
    serve.add_argument(
        "--local", action="store_true", help="all workers in this process, without Ray"
    )
    serve.add_argument("--log-level", choices=LEVELS, default="info", help="(info)")
    serve.add_argument(
        "--log-json", action="store_true", help="log one JSON object per line (log shippers)"
    )
    serve.set_defaults(func=run_serve)

    config = subparsers.add_parser("config", help="service config tools (check, reference)")
    commands = config.add_subparsers(dest="config_command", metavar="COMMAND", required=True)
    check = commands.add_parser(
        "check",
        help="validate a service YAML and print what it would start",
        description="Validate a service YAML (bucketserve/deploy/serve.yaml) without starting "
        "anything: "
        "unknown keys, wrong types and impossible values fail with the key path. When the "
        "model is on this machine its length is checked too. Exit 0 when valid.",
    )
    check.add_argument("file", type=Path, metavar="FILE")
    check.set_defaults(func=run_check)
    reference = commands.add_parser(
        "reference",
        help="print the key reference as Markdown (docs/configuration.md)",
        description="Print every config key (path, type, default, description) and every "
        "environment variable as Markdown, generated from the settings models.",
    )
    reference.set_defaults(func=run_reference)


def run_serve(args: argparse.Namespace) -> int:
    from bucketserve.deploy.service_runner import ServiceRunner

    configure_logging(args.log_level, args.log_json)
    try:
        runner = ServiceRunner.from_args(args)
    except ValueError as exc:
        print(f"bucketserve serve: {exc}", file=sys.stderr)
        return 2
    try:
        return runner.run()
    except BindError as exc:  # a port taken: the message says which key or flag to change
        print(f"bucketserve serve: {exc}", file=sys.stderr)
        return 1


def run_check(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from bucketserve.deploy.serve_config import ServeConfig, ServeConfigError
    from bucketserve.deploy.serve_config_summary import summarize

    out = out or sys.stdout
    try:
        config = ServeConfig.load(args.file)
        model_len = None
        if config.model_is_local():
            model_len = config.model_len(convert=False)
            config.controller_config(model_len)
    except ServeConfigError as exc:
        print(f"bucketserve config check: {exc}", file=sys.stderr)
        return 1
    out.write(f"{args.file}: valid\n{summarize(config, model_len)}\n")
    if model_len is None:
        out.write(
            f"note: model {config.controller.runner.model} is not on this machine; its length "
            "(max_model_len, L_max) is checked when serving\n"
        )
    return 0


def run_reference(args: argparse.Namespace) -> int:
    from bucketserve.deploy.config_reference import render

    sys.stdout.write(render())
    return 0
