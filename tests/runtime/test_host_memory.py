"""A CPU Device has glibc's malloc keep freed activations for reuse (process-wide, once);
the prefill benchmark shows what it buys, these show that it happens and can be turned off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")

PROBE = """
from bucketserve.runtime.cpu.host_memory import keep_freed_host_memory as keep
from bucketserve.runtime.worker.device import Device
before = keep.cache_info().currsize
Device("cpu")
print(before, keep.cache_info().currsize, keep())
"""


def probe(switch: str) -> list[str]:
    env = {**os.environ, "BUCKETSERVE_MALLOC_TUNING": switch}
    return subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=env
    ).stdout.split()


def test_a_cpu_device_tunes_malloc_once_and_the_switch_turns_it_off() -> None:
    assert probe("1") == ["0", "1", "True"]
    assert probe("0") == ["0", "1", "False"]
