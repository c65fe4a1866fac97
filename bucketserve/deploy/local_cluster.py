"""`ray up` on one machine: Ray's fake multi-node provider (worker "nodes" are local Ray
processes with the resources their node type declares, added and removed by the
autoscaler), plus the head and the command runner that `ray up`, `ray exec` and
`ray down` need, which Ray's provider leaves out (it expects `ray start --head
--autoscaling-config` by hand, and `ray up` crashes replacing its head).

The cluster lives in `provider.cluster_dir`: `ray/`, the Ray temp dir of every node, and
`home/`, the head's `~`. Every command the runner starts carries the dir in its
environment, and so does every process those start (Ray's daemons, the worker nodes, the
actors, a service started with `ray exec`). Stopping the cluster ends exactly those
processes: `ray stop` on this machine would end every Ray instance of the user, so the
runner never runs it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import psutil
from ray.autoscaler._private.command_runner import ProcessRunnerError
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
from ray.autoscaler.command_runner import CommandRunnerInterface
from ray.autoscaler.tags import NODE_KIND_HEAD, TAG_RAY_NODE_KIND

from bucketserve import envs
from bucketserve.runtime.io.default_model import CACHE_ENV, cache_root

logger = logging.getLogger(__name__)

RAY_STOP = "ray stop"
MARK = "BUCKETSERVE_LOCAL_CLUSTER"  # in the environment of every process of the cluster
ADDRESS_FILE = "ray/ray_current_cluster"  # `ray start --head` writes it into its temp dir


class LocalClusterProvider(FakeMultiNodeProvider):
    """FakeMultiNodeProvider whose head exists once `ray up` created it (a file in the
    cluster dir, so `ray up`, the autoscaler on the head and `ray down` agree)."""

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self.cluster_dir = Path(provider_config["cluster_dir"]).expanduser()
        self._head_file = self.cluster_dir / "head.json"
        if self._head_file.exists():
            self._nodes[self._head_node_id] = {"tags": json.loads(self._head_file.read_text())}
        else:
            del self._nodes[self._head_node_id]

    def create_node(self, node_config: dict, tags: dict, count: int) -> None:
        """`ray up` creates the head; its start commands then run on this machine."""
        if tags.get(TAG_RAY_NODE_KIND) != NODE_KIND_HEAD:
            raise ValueError("worker nodes are launched by the autoscaler on the head")
        (self.cluster_dir / "home").mkdir(parents=True, exist_ok=True)
        with self.lock:
            self._nodes[self._head_node_id] = {"tags": dict(tags)}
            self._save_head()

    def set_node_tags(self, node_id: str, tags: dict) -> None:
        with self.lock:
            self._nodes[node_id]["tags"].update(tags)
            if node_id == self._head_node_id:
                self._save_head()

    def terminate_node(self, node_id: str) -> None:
        if node_id != self._head_node_id:
            super().terminate_node(node_id)
            return
        if str(self.cluster_dir) == envs.BUCKETSERVE_LOCAL_CLUSTER:  # the autoscaler, on the head
            logger.warning("not terminating the head from inside the cluster: `ray down` does")
            return
        with self.lock:
            stop_cluster(self.cluster_dir)
            self._nodes.pop(node_id, None)
            self._head_file.unlink(missing_ok=True)

    def get_command_runner(self, log_prefix: str, node_id: str, *args: Any,
                           **kwargs: Any) -> CommandRunnerInterface:
        return LocalCommandRunner(self.cluster_dir)

    def _save_head(self) -> None:
        self._head_file.write_text(json.dumps(self._nodes[self._head_node_id]["tags"]))


class LocalCommandRunner(CommandRunnerInterface):
    """Runs a node's commands with bash on this machine, `~` being the cluster's home;
    `ray stop` ends this cluster's processes only."""

    def __init__(self, cluster_dir: Path) -> None:
        self.cluster_dir = cluster_dir
        self.home = cluster_dir / "home"

    def run(self, cmd: str | None = None, timeout: int = 120, exit_on_fail: bool = False,
            port_forward: Any = None, with_output: bool = False,
            environment_variables: dict[str, object] | None = None, run_env: str = "auto",
            ssh_options_override_ssh_key: str = "", shutdown_after_run: bool = False) -> str:
        if cmd is None:
            return ""
        if cmd.strip() == RAY_STOP:
            stop_cluster(self.cluster_dir)
            return ""
        # RAY_TMPDIR: Ray's temp dir is the cluster's, where `--ray-address auto` finds it
        env = {**os.environ, "HOME": str(self.home), "RAY_TMPDIR": str(self.cluster_dir),
               MARK: str(self.cluster_dir)}
        env.pop("RAY_ADDRESS", None)  # this machine's shell may point elsewhere
        # models converted once for this machine, not once per cluster home
        env.setdefault(CACHE_ENV, str(cache_root().parent))
        for name, value in (environment_variables or {}).items():
            env[name] = value if isinstance(value, str) else json.dumps(value)
        done = subprocess.run(["bash", "-c", cmd], env=env, text=True,
                              capture_output=with_output)
        if done.returncode != 0:
            if exit_on_fail:
                raise SystemExit(done.returncode)
            raise ProcessRunnerError("Command failed", "ssh_command_failed",
                                     code=done.returncode, command=cmd)
        return done.stdout if with_output else ""

    def run_rsync_up(self, source: str, target: str, options: dict | None = None) -> None:
        self._copy(Path(source), self._here(target))

    def run_rsync_down(self, source: str, target: str, options: dict | None = None) -> None:
        self._copy(self._here(source), Path(target).expanduser())

    def remote_shell_command_str(self) -> str:
        return f"cd {self.home} && bash"

    def run_init(self, *, as_head: bool, file_mounts: dict[str, str],
                 sync_run_yet: bool) -> bool | None:
        return None

    def _here(self, path: str) -> Path:
        return self.home / path[2:] if path.startswith("~/") else Path(path)

    @staticmethod
    def _copy(source: Path, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            shutil.copyfile(source, target)


def cluster_processes(cluster_dir: Path) -> list[psutil.Process]:
    """Every process of the cluster: those whose environment carries the cluster's mark
    (all the runner starts, and what they start), or whose command line names its dir;
    this process and its parents excepted."""
    spared = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    mine = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            if proc.pid in spared:
                continue
            named = any(str(cluster_dir) in part for part in proc.info["cmdline"] or ())
            if named or proc.environ().get(MARK) == str(cluster_dir):
                mine.append(proc)
    return mine


def stop_cluster(cluster_dir: Path, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, every process of the cluster."""
    mine = cluster_processes(cluster_dir)
    for proc in mine:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(mine, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    (cluster_dir / ADDRESS_FILE).unlink(missing_ok=True)
