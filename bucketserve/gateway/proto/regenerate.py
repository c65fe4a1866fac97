"""Regenerates the committed Python stubs from the .proto files.

Run from the repository root: `python -m bucketserve.gateway.proto.regenerate` (needs
grpcio-tools). `--check` compares instead of writing and exits 1 when stale.
The include root is the repository root, so the stubs import each other as
`bucketserve.gateway.proto.bucketserve.v1...` and work from an installed package.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO_DIR = Path(__file__).resolve().parent
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# The generator's own release, stamped into the stubs as the oldest runtime they accept:
# a newer grpcio-tools or protobuf changes these lines and nothing the .proto says.
STAMPS = (
    re.compile(rb"^GRPC_GENERATED_VERSION = '[^']*'$", re.M),
    re.compile(rb"^# Protobuf Python Version: .*$", re.M),
    re.compile(rb"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.\w+,)[\s\d,]*"),
)


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Writes the stubs under `out_dir` (mirroring the repository layout); returns them."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    protos = [str(p.relative_to(ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    stems = [out_dir / p.removesuffix(".proto") for p in protos]
    return [path for stem in stems for s in SUFFIXES if (path := Path(f"{stem}{s}")).is_file()]


def unstamped(stub: bytes) -> bytes:
    for stamp in STAMPS:
        stub = stamp.sub(rb"\1" if stamp.groups else b"", stub)
    return stub


def stale_files() -> list[str]:
    """Stub paths whose committed content differs from a fresh generation, version stamps
    aside."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for path in fresh:
            rel = path.relative_to(tmp)
            committed = ROOT / rel
            if not committed.is_file() or unstamped(committed.read_bytes()) != unstamped(
                path.read_bytes()
            ):
                stale.append(str(rel))
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the stubs are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for rel in stale:
            print(f"stale: {rel}", file=sys.stderr)
        return 1 if stale else 0
    for path in generate(ROOT):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
