"""bucketserve/deploy/cluster-local.yaml's provider: a head that `ray up`, the autoscaler and `ray
down`
agree on, commands run on this machine in the cluster's home, and a stop that ends the
cluster's processes and nothing else."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from ray.autoscaler._private.command_runner import ProcessRunnerError
from ray.autoscaler.tags import (
    NODE_KIND_HEAD,
    NODE_KIND_WORKER,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_STATUS,
)

from bucketserve.deploy.local_cluster import (
    MARK,
    LocalClusterProvider,
    LocalCommandRunner,
    stop_cluster,
)

HEAD = {TAG_RAY_NODE_KIND: NODE_KIND_HEAD}


@pytest.fixture
def provider_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("RAY_FAKE_CLUSTER", "1")
    monkeypatch.delenv(MARK, raising=False)
    return {"type": "external", "cluster_dir": str(tmp_path / "c")}


def test_the_head_exists_once_ray_up_created_it_for_every_process(
    provider_config: dict[str, str],
) -> None:
    up = LocalClusterProvider(provider_config, "c")
    assert up.non_terminated_nodes(HEAD) == []
    up.create_node({}, {**HEAD, TAG_RAY_NODE_STATUS: "uninitialized"}, 1)
    (head,) = up.non_terminated_nodes(HEAD)
    up.set_node_tags(head, {TAG_RAY_NODE_STATUS: "up-to-date"})
    down = LocalClusterProvider(provider_config, "c")  # `ray down`, another process
    assert down.non_terminated_nodes(HEAD) == [head]
    assert down.node_tags(head)[TAG_RAY_NODE_STATUS] == "up-to-date"
    with pytest.raises(ValueError, match="autoscaler"):
        up.create_node({}, {TAG_RAY_NODE_KIND: NODE_KIND_WORKER}, 1)
    down.terminate_node(head)
    assert LocalClusterProvider(provider_config, "c").non_terminated_nodes(HEAD) == []


def test_the_autoscaler_on_the_head_never_terminates_the_head(
    provider_config: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    up = LocalClusterProvider(provider_config, "c")
    up.create_node({}, dict(HEAD), 1)
    monkeypatch.setenv(MARK, provider_config["cluster_dir"])  # a process of the cluster
    monitor = LocalClusterProvider(provider_config, "c")
    (head,) = monitor.non_terminated_nodes(HEAD)
    monitor.terminate_node(head)
    assert LocalClusterProvider(provider_config, "c").non_terminated_nodes(HEAD) == [head]


def test_commands_run_here_in_the_cluster_home_and_fail_loudly(tmp_path: Path) -> None:
    runner = LocalCommandRunner(tmp_path / "c")
    (tmp_path / "c" / "home").mkdir(parents=True)
    (tmp_path / "config.yaml").write_text("x: 1\n")
    runner.run_rsync_up(str(tmp_path / "config.yaml"), "~/ray_bootstrap_config.yaml")
    out = runner.run(f"cat ~/ray_bootstrap_config.yaml; echo $RAY_TMPDIR ${MARK} $EXTRA",
                     with_output=True, environment_variables={"EXTRA": {"HPU": 2}})
    cluster = str(tmp_path / "c")
    assert out.split("\n") == ["x: 1", f"{cluster} {cluster} {{\"HPU\": 2}}", ""]
    with pytest.raises(ProcessRunnerError):
        runner.run("exit 3")


@pytest.fixture
def sleepers(tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """`sleep` processes marked as this cluster's, another cluster's, and unmarked."""
    marks = {"mine": str(tmp_path / "c"), "other": str(tmp_path / "c2"), "none": None}
    procs = {}
    for name, mark in marks.items():
        env = {k: v for k, v in os.environ.items() if k != MARK}
        if mark:
            env[MARK] = mark
        procs[name] = subprocess.Popen(["sleep", "60"], env=env)
    yield procs
    for proc in procs.values():
        proc.kill()
        proc.wait()


def test_stopping_the_cluster_ends_its_processes_and_no_other(
    tmp_path: Path, sleepers: dict[str, subprocess.Popen[bytes]]
) -> None:
    stop_cluster(tmp_path / "c", grace_s=5)
    assert sleepers["mine"].wait(timeout=5) is not None
    for name in ("other", "none"):
        assert psutil.Process(sleepers[name].pid).status() != psutil.STATUS_ZOMBIE
        assert sleepers[name].poll() is None
