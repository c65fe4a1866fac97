"""`ray up bucketserve/deploy/cluster-local.yaml`, the service on it via `ray exec`, `ray down`
(slow).

The shipped recipe runs in a temp dir of its own on free ports (the only edits to it);
the `ray` CLI runs with its own HOME, whose token file the recipe mounts onto the head.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from bucketserve.deploy.local_cluster import cluster_processes, stop_cluster
from tests.deploy import ray_cluster as rc

DEPLOY = Path(__file__).resolve().parents[2] / "bucketserve" / "deploy"
SHIPPED_DIR = "/tmp/bucketserve-local"
SHIPPED_PORTS = ("6380", "6381", "8275")  # GCS, Ray client server, dashboard
HEAD_ID = "f" * 51 + "00000"  # Ray's fake head node id


@dataclass
class LocalCluster:
    recipe: Path
    cluster_dir: Path
    env: dict[str, str]  # for the `ray` CLI on this machine
    driver_env: dict[str, str]  # for a driver of the test's own (the placement probe)

    def ray(self, *args: str, timeout: float = 300) -> str:
        done = subprocess.run([rc.RAY, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"ray {args[0]} failed: {done.stderr[-3000:]}"
        return done.stdout


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[LocalCluster]:
    """bucketserve/deploy/cluster-local.yaml brought up; `ray down` and its check are the
    test's. Ends whatever the cluster left running, whatever happened."""
    work = Path(tempfile.mkdtemp(prefix="bsup", dir="/tmp"))  # short: unix socket paths
    cluster_dir, home = work / "c", work / "home"
    text = (DEPLOY / "cluster-local.yaml").read_text().replace(SHIPPED_DIR, str(cluster_dir))
    for port in SHIPPED_PORTS:
        text = text.replace(port, str(rc.free_port()))
    recipe = work / "cluster-local.yaml"
    recipe.write_text(text)
    token = secrets.token_hex(32)
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(token)
    venv_bin = Path(rc.RAY).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= {"HOME": str(home), "PATH": f"{venv_bin}:{env['PATH']}", "RAY_FAKE_CLUSTER": "1",
            "RAY_USAGE_STATS_ENABLED": "0"}
    cluster = LocalCluster(recipe, cluster_dir, env, {})
    try:
        cluster.ray("up", str(recipe), "-y", "--no-config-cache")
        address = (cluster_dir / "ray" / "ray_current_cluster").read_text().strip()
        cluster.driver_env = {**env, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "token",
                              "RAY_AUTH_TOKEN": token}
        yield cluster
    finally:
        if cluster_processes(cluster_dir):
            subprocess.run([rc.RAY, "down", str(recipe), "-y"], env=env, capture_output=True,
                           timeout=300)
            stop_cluster(cluster_dir)
        shutil.rmtree(work, ignore_errors=True)


def serve_on(cluster: LocalCluster, tmp_path: Path, model_dir: Path,
             **roles: dict[str, Any]) -> tuple[subprocess.Popen[str], str]:
    """`ray exec RECIPE 'bucketserve serve --config serve-local.yaml --ray-address auto'`
    with the tiny model and `roles` (prefill=/decode= keys) over the shipped config; the
    process and its gRPC target."""
    config = yaml.safe_load((DEPLOY / "serve-local.yaml").read_text())
    config["model"]["path"] = str(model_dir)
    config["kv_cache"] = {"block_size": 4, "num_blocks": 128}
    for role, keys in roles.items():
        config["controller"][role] |= keys
    config["gateway"] = {"grpc_port": 0, "http_port": None, "drain_timeout_s": 1.0}
    path, log = tmp_path / "serve.yaml", tmp_path / "serve.log"
    path.write_text(yaml.safe_dump(config))
    command = f"bucketserve serve --config {path} --ray-address auto"
    with log.open("w") as err:
        proc = subprocess.Popen([rc.RAY, "exec", str(cluster.recipe), command],
                                env=cluster.env, stdout=subprocess.PIPE, stderr=err, text=True)
    return proc, rc.grpc_target(proc, log)


def stop_service(proc: subprocess.Popen[str]) -> None:
    """Ctrl-C to `bucketserve serve` (a child of `ray exec`): it drains and exits 0."""
    children = psutil.Process(proc.pid).children(recursive=True)
    service = [c for c in children if "serve" in c.cmdline() and "bucketserve" in
               " ".join(c.cmdline())]
    try:
        assert service, [c.cmdline() for c in children]
    finally:
        rc.ctrl_c(proc, service or None)


@pytest.mark.slow
def test_ray_up_serves_on_the_hpu_nodes_and_a_worker_more_than_they_hold_brings_a_node_up(
    local_cluster: LocalCluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """One prefill and two decode workers, one card each, where `ray up` starts one gaudi
    node of two cards (min_workers 1): two workers fill it and the third makes the
    autoscaler bring up a second node. The head, with no cards, holds none."""
    gaudi = yaml.safe_load(local_cluster.recipe.read_text())["available_node_types"]["gaudi"]
    assert (gaudi["min_workers"], gaudi["resources"]["HPU"]) == (1, 2)
    proc, target = serve_on(local_cluster, tmp_path, tiny_model_dir, decode={"num_workers": 2})
    try:
        rc.assert_greedy_matches_in_process(target, tiny_model_dir)
        placed = rc.placement(local_cluster.driver_env)
    finally:
        stop_service(proc)
    hpu_nodes = {node for node, names in placed["nodes"].items() if "HPU" in names}
    assert HEAD_ID in placed["nodes"] and HEAD_ID not in hpu_nodes  # the head has no cards
    assert len(hpu_nodes) == 2  # one more than min_workers: brought up for the third worker
    classes = sorted(cls for cls, _ in placed["actors"])
    assert classes == ["DecodeWorker", "DecodeWorker", "PrefillWorker"]
    per_node = Counter(node for _, node in placed["actors"])
    assert set(per_node) == hpu_nodes and sorted(per_node.values()) == [1, 2]  # 2 cards a node


@pytest.mark.slow
def test_ray_down_ends_every_process_of_the_cluster(local_cluster: LocalCluster) -> None:
    assert cluster_processes(local_cluster.cluster_dir)
    local_cluster.ray("down", str(local_cluster.recipe), "-y")
    assert [p.cmdline() for p in cluster_processes(local_cluster.cluster_dir)] == []
