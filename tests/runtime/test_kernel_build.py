"""`KernelBuild` with real compilers and real processes: a failure is recorded and never
retried until `--force`, the compiler's output stays in the log, and processes starting
together wait for one build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bucketserve.runtime.cpu.kernels import ENV_SWITCH, ISA_ENV, KernelBuild
from bucketserve.runtime.io.default_model import CACHE_ENV

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # a loaded 2-core machine: importing torch and a native build take a while
LOAD = (
    "import logging; logging.basicConfig(); from bucketserve.runtime.cpu import kernels; "
    "print(kernels.load())"
)
# Two processes load at once: each announces itself in a folder, then waits for the other.
LOAD_TOGETHER = """
import logging, sys, time
from pathlib import Path
logging.basicConfig()
from bucketserve.runtime.cpu import kernels
ready = Path(sys.argv[1])
(ready / sys.argv[2]).touch()
deadline = time.monotonic() + 120
while len(list(ready.iterdir())) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
loaded = kernels.load()
print(loaded._library._name if loaded else None)
"""


def environment(cache: Path, compiler: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_SWITCH, ISA_ENV)}
    return {**env, CACHE_ENV: str(cache), "CC": str(compiler), **extra}


def script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}")
    path.chmod(0o755)
    return path


def python(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def test_the_isa_reaches_march_and_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISA_ENV, raising=False)
    native = KernelBuild()
    monkeypatch.setenv(ISA_ENV, "x86-64-v3")
    level = KernelBuild()
    assert native.isa == "native" and "-march=native" in native.flags
    assert level.isa == "x86-64-v3" and "-march=x86-64-v3" in level.flags
    assert level.path != native.path
    assert KernelBuild("x86-64-v2").isa == "x86-64-v2"  # an argument beats the variable


def test_a_failed_build_is_recorded_kept_off_the_console_and_forced(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    compiler = script(tmp_path / "fake-cc", f"""echo "$@" >> {runs}
echo "cpu_kernels.c:1:1: error: fake compiler refuses" >&2
echo "cpu_kernels.c:1:1: note: a detail only the log holds" >&2
echo "compilation terminated." >&2
exit 1
""")
    env = environment(tmp_path / "cache", compiler, **{ISA_ENV: "x86-64-v3"})

    for _ in range(2):  # one process after the other: the second finds the record
        loaded = python(env, "-c", LOAD)
        assert loaded.returncode == 0, loaded.stderr
        assert loaded.stdout.strip() == "None"
        [warning] = [line for line in loaded.stderr.splitlines() if line.strip()]
        assert len(loaded.stderr.strip().splitlines()) == 1, loaded.stderr
        [log] = (tmp_path / "cache" / "kernels").glob("cpu_kernels-*.log")
        assert warning.startswith("WARNING:bucketserve.runtime.cpu.kernels:")
        assert "the torch code runs" in warning and "-march=x86-64-v3" in warning
        assert f"log: {log};" in warning and "error: fake compiler refuses" in warning
        assert "detail only the log holds" not in loaded.stderr
        assert "compilation terminated" not in loaded.stderr
    assert runs.read_text().count("\n") == 1
    assert "-march=x86-64-v3" in runs.read_text()
    text = log.read_text()
    assert "detail only the log holds" in text and "compilation terminated" in text
    assert text.startswith(f"$ {compiler} ")
    record = json.loads(log.with_suffix(".failed").read_text())
    assert record["isa"] == "x86-64-v3" and record["compiler"] == str(compiler)
    assert record["error"] == "error: fake compiler refuses" and record["log"] == str(log)

    forced = python(env, "-m", "bucketserve.cli", "kernels", "build", "--force")
    assert forced.returncode == 1, forced.stdout + forced.stderr
    assert runs.read_text().count("\n") == 2
    assert "fake-cc failed for -march=x86-64-v3 (error: fake compiler refuses)" in forced.stderr
    assert "detail only the log holds" not in forced.stdout + forced.stderr
    assert log.with_suffix(".failed").is_file()


@pytest.mark.slow  # builds the kernels in several processes
def test_processes_starting_together_wait_for_one_build(tmp_path: Path) -> None:
    real = shutil.which("cc") or shutil.which("gcc")
    if real is None:
        pytest.skip("no C compiler on PATH")
    runs = tmp_path / "runs"
    # The pause keeps the first build running while the other process asks for the library.
    compiler = script(tmp_path / "slow-cc", f'echo run >> {runs}\nsleep 1\nexec {real} "$@"\n')
    env = environment(tmp_path / "cache", compiler)
    ready = tmp_path / "ready"
    ready.mkdir()

    starts = [
        subprocess.Popen([sys.executable, "-c", LOAD_TOGETHER, str(ready), name], env=env,
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name in ("a", "b")
    ]
    outputs = [process.communicate(timeout=TIMEOUT_S) for process in starts]
    for process, (_, stderr) in zip(starts, outputs, strict=True):
        assert process.returncode == 0, stderr
    paths = {stdout.strip() for stdout, _ in outputs}
    [library] = paths
    assert library.endswith(".so") and Path(library).is_file(), outputs
    assert runs.read_text() == "run\n"

    # Now cached: the command finds it without compiling.
    cached = python(env, "-m", "bucketserve.cli", "kernels", "build")
    assert cached.returncode == 0, cached.stderr
    assert cached.stdout.strip() == f"{library} (-march=native, cached)"
    assert runs.read_text() == "run\n"
    assert not list((tmp_path / "cache" / "kernels").glob("*.tmp"))
