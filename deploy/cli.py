"""`bucketserve config check FILE`: validate a service config without starting anything."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO


def register(subparsers: Any) -> None:
    config = subparsers.add_parser("config", help="service config tools (check)")
    commands = config.add_subparsers(dest="config_command", metavar="COMMAND", required=True)
    check = commands.add_parser(
        "check",
        help="validate a service YAML and print what it would start",
        description="Validate a service YAML (deploy/serve.yaml) without starting anything: "
        "unknown keys, wrong types and impossible values fail with the key path. When the "
        "model is on this machine its length is checked too. Exit 0 when valid.",
    )
    check.add_argument("file", type=Path, metavar="FILE")
    check.set_defaults(func=run_check)


def run_check(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from deploy.serve_config import ServeConfig, ServeConfigError

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
    out.write(f"{args.file}: valid\n{config.summary(model_len)}\n")
    if model_len is None:
        out.write(
            f"note: model {config.controller.runner.model} is not on this machine; its length "
            "(max_model_len, L_max) is checked when serving\n"
        )
    return 0
