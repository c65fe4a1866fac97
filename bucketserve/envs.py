"""Every environment variable bucketserve reads, in one place (as vLLM's `envs.py`).

Read one as an attribute, `envs.BUCKETSERVE_CACHE_DIR`: the value is parsed from the
environment at each access, so a test or a launcher that sets a variable sees it take effect.
`docs/configuration.md` lists them (generated from `VARIABLES`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _flag(raw: str) -> bool:
    return raw.strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    parse: Callable[[str], Any]
    doc: str

    def read(self) -> Any:
        raw = os.environ.get(self.name) or self.default  # set but empty: unset
        return None if raw is None else self.parse(raw)


VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "BUCKETSERVE_CACHE_DIR",
            "~/.cache/bucketserve",
            lambda raw: Path(raw).expanduser(),
            "Where converted models (`models/`) and built CPU kernels (`kernels/`) are cached.",
        ),
        EnvVar(
            "BUCKETSERVE_CPU_ISA",
            "native",
            str,
            "The `-march` the CPU kernels are built for: `native`, or a level such as "
            "`x86-64-v3` (AVX2) to build for other machines of a cluster.",
        ),
        EnvVar(
            "BUCKETSERVE_CPU_KERNELS",
            "1",
            _flag,
            "`0` turns the C kernels off; the model then runs the torch code they replace.",
        ),
        EnvVar(
            "BUCKETSERVE_AMX",
            "1",
            _flag,
            "`0` keeps bfloat16 prompt chunks off the AMX tiles where the CPU has them.",
        ),
        EnvVar(
            "BUCKETSERVE_MALLOC_TUNING",
            "1",
            _flag,
            "`0` leaves glibc's malloc thresholds as they are (workers otherwise keep freed "
            "host memory mapped, so steps do not fault pages in again).",
        ),
        EnvVar(
            "BUCKETSERVE_BUCKET_FILE",
            None,
            str,
            "The shape-bucket file, when the config's shape bucket strategy is `file` and "
            "names none.",
        ),
        EnvVar(
            "BUCKETSERVE_API_KEY",
            None,
            str,
            "The client SDK's and CLI's default API key (the tenant's bearer token).",
        ),
        EnvVar(
            "BUCKETSERVE_TARGET",
            None,
            str,
            "The CLI's default server address for `generate` and `chat` (host:port).",
        ),
        EnvVar(
            "BUCKETSERVE_LOCAL_CLUSTER",
            None,
            str,
            "Set by `deploy/cluster-local.yaml`'s provider in every process of that laptop "
            "cluster, so `ray down` finds them; not for users to set.",
        ),
    )
}


def __getattr__(name: str) -> Any:
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module 'bucketserve.envs' has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])
