"""The kernels built for an ISA this machine does not run natively (aarch64: NEON, 4-float
vectors), checked against scalar references under qemu-user (`cpu_kernels_check.c`).

Needs Debian's `gcc-aarch64-linux-gnu` and `qemu-user`; skipped without them (CI has
neither). The x86 builds are covered through torch by test_cpu_kernels.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("cpu_kernels_check.c")
CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64")


@pytest.mark.skipif(CROSS is None or QEMU is None,
                    reason="no aarch64 cross compiler and qemu-user here")
@pytest.mark.parametrize("march", ["armv8-a", "armv8.2-a+fp16+dotprod"])
def test_aarch64_kernels_match_scalar_references(march: str, tmp_path: Path) -> None:
    binary = tmp_path / "check"
    subprocess.run(
        [CROSS, "-O3", "-ffast-math", f"-march={march}", "-fopenmp", "-o", str(binary),
         str(CHECK), "-lm"],
        check=True, capture_output=True, text=True, timeout=600,
    )
    ran = subprocess.run([QEMU, "-L", "/usr/aarch64-linux-gnu", str(binary)],
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0 and ran.stdout.rstrip().endswith("0 failed"), ran.stdout
    assert "(worst relative error" in ran.stdout and "4 lanes" in ran.stdout
