"""Building `cpu_kernels.c` into a shared library once per machine, source and target ISA.

Every process that serves a model (each Ray worker) asks for the library when it starts, so
the build must be cheap to ask for and expensive at most once: the library is cached under a
key of everything that shapes it, processes starting together wait on a file lock for one
build, and a build that fails is recorded so later processes go straight to the torch code
instead of spending minutes on the same failure. Only `bucketserve kernels build --force`
clears that record. The compiler's output goes to a log file, never to the console.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path

from bucketserve import envs

SOURCE = Path(__file__).with_name("cpu_kernels.c")
ISA_ENV = "BUCKETSERVE_CPU_ISA"
DEFAULT_ISA = "native"
TIMEOUT_S = 300
RETRY = "bucketserve kernels build --force"
# The first line of a compiler's output that says what went wrong ("fatal error: x.h: ...").
_ERROR_LINE = re.compile(r"(?:fatal )?error\b.*", re.IGNORECASE)


class KernelBuildError(RuntimeError):
    """The library could not be built, now or in an earlier process (a recorded failure);
    the message is one line: what failed, for which ISA, where the log is, how to retry."""


class KernelBuild:
    """The library for one source, compiler and target ISA on this machine, and its files in
    `<cache>/kernels/`: `cpu_kernels-<key>.so`, `.log` (the last build's command and output),
    `.failed` (a JSON record of a failed build) and `.lock`.

    The key hashes the source, the compiler, every flag and the CPU's feature flags: a new
    source, compiler, ISA or CPU gets a fresh build, and a compiler installed after a failure
    resolves to a new path, hence a new key, so the old failure record no longer applies.
    """

    def __init__(self, isa: str | None = None, source: Path = SOURCE) -> None:
        self.source = source
        # -march=native builds for (and caches on) the CPU that runs it; a named level such as
        # x86-64-v3 (AVX2 + FMA) builds code every CPU of that level, AVX-512 ones too, runs.
        self.isa = isa or envs.BUCKETSERVE_CPU_ISA or DEFAULT_ISA
        # $CC may be a missing program: the failed start is recorded like any other failure.
        self.compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
        # -ffast-math + libmvec: vector expf and reassociated sums (the source keeps every
        # value finite). torch's libgomp is already loaded: the OpenMP runtime is shared.
        self.flags = ["-O3", "-ffast-math", f"-march={self.isa}", "-fopenmp", "-shared", "-fPIC"]
        self.libs: list[str] = []
        if platform.machine() == "x86_64":
            # Full-width vectors in the auto-vectorised loops too (GCC's Intel targets prefer
            # 256 bits); a target without AVX-512 ignores it.
            self.flags.append("-mprefer-vector-width=512")
            self.libs.append("-lmvec")
        described = " ".join([self.compiler, *self.flags, *self.libs, platform.machine()])
        digest = hashlib.sha256(source.read_bytes() + (described + _cpu_flags()).encode())
        self.directory = envs.BUCKETSERVE_CACHE_DIR / "kernels"
        self.path = self.directory / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
        self.log_path = self.path.with_suffix(".log")
        self.failed_path = self.path.with_suffix(".failed")
        self.lock_path = self.path.with_suffix(".lock")
        self.seconds: float | None = None  # how long this object's build took; None if cached

    def library(self, force: bool = False) -> Path:
        """The built library's path, compiling it first where no process has; raises
        `KernelBuildError` if the build fails now or failed before. `force` clears a recorded
        failure and builds again even where a library is cached."""
        if not force:
            # No lock on the way that almost every call takes: a finished library or record.
            if self.path.is_file():
                return self.path
            self._raise_if_failed()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(self.lock_path, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                # Whoever held the lock before may have built the library or failed to.
                if force:
                    self.failed_path.unlink(missing_ok=True)
                elif self.path.is_file():
                    return self.path
                else:
                    self._raise_if_failed()
                self._compile()
                return self.path
        except OSError as exc:
            raise KernelBuildError(f"cannot build the CPU kernels in {self.directory}: {exc}") \
                from exc

    def _compile(self) -> None:
        """Compile into a temporary file beside the library, then rename it: a process
        never finds half a library. A failure is recorded, then raised."""
        fd, tmp = tempfile.mkstemp(prefix=f"{self.path.stem}.", suffix=".tmp", dir=self.directory)
        os.close(fd)
        command = [self.compiler, *self.flags, "-o", tmp, str(self.source), *self.libs]
        start = time.monotonic()
        try:
            error = self._run(command)
            if error is None:
                os.replace(tmp, self.path)
                self.seconds = time.monotonic() - start
                return
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        record = {
            "isa": self.isa,
            "compiler": self.compiler,
            "error": error,
            "log": str(self.log_path),
            "time": datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        _write_atomically(self.failed_path, json.dumps(record, indent=1) + "\n")
        raise KernelBuildError(_reason(record))

    def _run(self, command: list[str]) -> str | None:
        """Run the compiler with its output in the log; None on success, else what went
        wrong in a few words (the first error line of the output where there is one)."""
        with open(self.log_path, "w") as log:
            log.write(f"$ {shlex.join(command)}\n")
            log.flush()
            output_start = log.tell()
            try:
                # Its own session: on a timeout the whole group goes (gcc's cc1 included).
                compiler = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                log.write(f"could not start the compiler: {exc}\n")
                return f"cannot run {self.compiler}: {exc.strerror or exc}"
            try:
                status = compiler.wait(timeout=TIMEOUT_S)
            except BaseException as exc:  # the timeout, or this process interrupted
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(compiler.pid, signal.SIGKILL)
                compiler.wait()
                if not isinstance(exc, subprocess.TimeoutExpired):
                    raise
                log.write(f"\ntimed out after {TIMEOUT_S} s; killed\n")
                return f"timed out after {TIMEOUT_S} s"
            log.write(f"\nexit status {status}\n")
        if status == 0:
            return None
        with open(self.log_path) as log:
            log.seek(output_start)
            for line in log:
                found = _ERROR_LINE.search(line)
                if found:
                    return found.group(0).strip()[:200]
        return f"exit status {status}"

    def _raise_if_failed(self) -> None:
        """Raise the recorded failure of an earlier build, if there is one."""
        try:
            text = self.failed_path.read_text()
        except FileNotFoundError:
            return
        try:
            record = json.loads(text)
        except ValueError:
            record = {}
        defaults = {"isa": self.isa, "compiler": self.compiler, "error": "recorded failure",
                    "log": str(self.log_path)}
        raise KernelBuildError(_reason({**defaults, **record}))


def _reason(record: dict) -> str:
    """A failure record as one line."""
    name = Path(record["compiler"]).name
    return (f"{name} failed for -march={record['isa']} ({record['error']}); "
            f"log: {record['log']}; retry: {RETRY}")


def _write_atomically(path: Path, text: str) -> None:
    """Write through a temporary file and a rename: a reader sees no half-written record."""
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cpu_flags() -> str:
    """The CPU's feature flags line (a different CPU under the same cache gets its own build)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
