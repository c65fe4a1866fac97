"""A CPU Device has glibc's malloc keep freed activations for reuse (process-wide, once);
the prefill benchmark shows what it buys, these show that it happens and can be turned off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bucketserve.runtime.worker.device import MALLOC_ENV

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")

PROBE = """
import bucketserve.runtime.worker.device as d
before = d.keep_freed_host_memory.cache_info().currsize
d.Device("cpu")
print(before, d.keep_freed_host_memory.cache_info().currsize, d.keep_freed_host_memory())
"""


def probe(switch: str) -> list[str]:
    env = {**os.environ, MALLOC_ENV: switch}
    return subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=env
    ).stdout.split()


def test_a_cpu_device_tunes_malloc_once_and_the_switch_turns_it_off() -> None:
    assert probe("1") == ["0", "1", "True"]
    assert probe("0") == ["0", "1", "False"]
