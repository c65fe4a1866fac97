"""`bucketserve serve` as a user starts it, in a process (and session) of its own: its
targets from the banner, its worker actors' processes, Ctrl-C, and what is left after."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import yaml

WORKER_TITLES = ("ray::DecodeWorker", "ray::PrefillWorker", "ray::StageActor")


class ServeProcess:
    """`start` writes `config` (the service YAML, as a dict) next to the log and waits for the
    banner; the service runs in a new session, so Ctrl-C (`interrupt`) reaches its whole
    process group as a terminal's would, and `leftovers` finds anything of it still alive."""

    def __init__(self, proc: subprocess.Popen[str], log: Path, banner: str) -> None:
        self.proc = proc
        self.log = log
        self.banner = banner
        self.grpc_target = re.search(r"gRPC\s+(\S+)", banner).group(1)
        http = re.search(r"HTTP\s+(\S+)", banner)
        self.http_url = http.group(1) if http else None
        self.model_name = re.search(r"serving (\S+)", banner).group(1)
        self.seen: dict[int, float] = {}  # {pid: create time} of its tree's processes met
        self.tree()

    @classmethod
    def start(
        cls, config: dict[str, Any], workdir: Path, env: dict[str, str] | None = None,
        timeout_s: float = 600.0,
    ) -> ServeProcess:
        workdir.mkdir(parents=True, exist_ok=True)
        path, log = workdir / "serve.yaml", workdir / "serve.log"
        path.write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "bucketserve.cli", "serve", "--config", str(path)]
        with log.open("w") as err:
            proc = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=err, text=True,
                start_new_session=True, env=env,
            )
        try:
            banner = _read_banner(proc, log, time.monotonic() + timeout_s)
        except BaseException:
            cls._kill_session(proc)
            raise
        return cls(proc, log, banner)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tree(self) -> list[psutil.Process]:
        """The service process and every process below it now (Ray's daemons and workers)."""
        try:
            root = psutil.Process(self.pid)
            found = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        for process in found:
            try:
                self.seen[process.pid] = process.create_time()
            except psutil.Error:
                continue
        return found

    def workers(self) -> dict[int, str]:
        """{pid: title} of its worker actors' processes."""
        self.tree()
        return worker_processes(self.pid)

    def wait_for_workers(self, count: int = 1, timeout_s: float = 300.0,
                         exclude: set[int] = frozenset()) -> dict[int, str]:
        """The worker processes once `count` are up (none of them in `exclude`: a restart's
        new process, not the killed one)."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = {p: t for p, t in self.workers().items() if p not in exclude}
            if len(workers) >= count:
                return workers
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} worker processes not up in {timeout_s:g}s: {workers}")
            time.sleep(0.2)

    def interrupt(self, timeout_s: float = 120.0) -> int:
        """Ctrl-C: SIGINT to the service's process group; its exit status."""
        self.tree()
        os.killpg(self.pid, signal.SIGINT)
        return self.proc.wait(timeout=timeout_s)

    def leftovers(self, timeout_s: float = 60.0) -> list[str]:
        """Processes of the service (met in its tree, or in its session) still alive after
        `timeout_s`; [] as soon as there are none."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [
                f"{process.info['name']} (pid {process.pid})"
                for process in psutil.process_iter(["name", "status", "create_time"])
                if process.info["status"] != psutil.STATUS_ZOMBIE and self._mine(process)
            ]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.5)

    def _mine(self, process: psutil.Process) -> bool:
        """Met in its tree (the same process, not a later one with its pid) or in its
        session."""
        if process.pid == os.getpid():
            return False
        if self.seen.get(process.pid) == process.info["create_time"]:
            return True
        try:
            return os.getsid(process.pid) == self.pid
        except OSError:
            return False

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """An exception inside carries what the service said last: a test that fails on a
        dropped connection tells whether the service died, how, and why."""
        try:
            yield
        except Exception as exc:
            raise AssertionError(f"{exc!r}\n{self.report()}") from exc

    def report(self, lines: int = 40) -> str:
        """Whether the service runs (else its exit status), the end of its log, its Ray
        driver's and its raylet's."""
        code = self.proc.poll()
        state = "is running" if code is None else f"exited with status {code}"
        parts = [f"the service {state}; the end of {self.log}:", _tail(self.log, lines)]
        ray_dir = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray"
        for driver in ray_dir.glob(f"session_*/logs/python-core-driver-*_{self.pid}.log"):
            for path in (driver, driver.with_name("raylet.out")):
                parts += [f"the end of {path}:", _tail(path, lines)]
        return "\n".join(parts)

    def close(self) -> None:
        """Stop it whatever its state: Ctrl-C, then SIGKILL to its session if it lingers."""
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired, ProcessLookupError):
                self.interrupt(timeout_s=60)
        self._kill_session(self.proc, self.seen)

    @staticmethod
    def _kill_session(proc: subprocess.Popen[str], seen: dict[int, float] | None = None) -> None:
        """SIGKILL to every process of its session, and to those met in its tree (the same
        processes: a pid a later process took is left alone)."""
        seen = seen or {}
        for process in psutil.process_iter(["pid", "create_time"]):
            pid = process.info["pid"]
            try:
                met = seen.get(pid) == process.info["create_time"]
                if pid != os.getpid() and (met or os.getsid(pid) == proc.pid):
                    process.kill()
            except (OSError, psutil.Error):
                continue
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def worker_processes(root_pid: int | None = None) -> dict[int, str]:
    """{pid: title} of worker actors' processes, which Ray retitles `ray::DecodeWorker`
    (`ray::DecodeWorker.next_outputs` during a call), `ray::PrefillWorker`, ...: those below
    `root_pid`, or without one every such process of this user on the machine (a service
    started elsewhere)."""
    if root_pid is not None:
        try:
            processes = psutil.Process(root_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return {}
    else:
        me = psutil.Process().username()
        processes = [p for p in psutil.process_iter(["username"]) if p.info["username"] == me]
    found = {}
    for process in processes:
        try:
            command = process.cmdline()
        except psutil.Error:
            continue
        if command and command[0].startswith(WORKER_TITLES):
            found[process.pid] = command[0].split()[0].split(".")[0]
    return found


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({exc.strerror})"


def _read_banner(proc: subprocess.Popen[str], log: Path, deadline: float) -> str:
    """stdout up to the banner's last line. The read blocks; a service that hangs before its
    banner is ended by the caller's own timeout (pytest-timeout), and one that exits early
    ends the read."""
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("Ctrl-C"):
            return "".join(lines)
        if time.monotonic() > deadline:
            break
    raise RuntimeError(f"serve did not start: {log.read_text()[-3000:]}")
