"""The `bucketserve` console command.

Each component contributes its subcommands through a `register(subparsers)`
function in its own `cli` module, so this file only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that provide `register(subparsers)`; missing ones are skipped so a
# partial install still answers `--help`.
_COMMAND_MODULES = (
    "bucketserve.runtime.cli",
    "bucketserve.bucket_manager.cli",
    "bucketserve.deploy.cli",
    "bucketserve.gateway.cli",
    "bucketserve.bench.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bucketserve",
        description="Disaggregated prefill/decode LLM serving with adaptive buckets.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
