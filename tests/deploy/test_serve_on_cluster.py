"""`bucketserve serve --ray-address auto` joins a running two-node Ray cluster (slow)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from bucketserve.deploy.local_cluster import MARK, stop_cluster
from tests.deploy.ray_cluster import (
    RAY,
    assert_greedy_matches_in_process,
    ctrl_c,
    free_port,
    grpc_target,
    placement,
)


@pytest.fixture
def ray_cluster() -> Iterator[dict[str, str]]:
    """A head with `HPU: 1, prefill_node: 1` and a second node with `HPU: 1, decode_node: 1`,
    on this machine, in a temp dir of their own; the env that reaches it. Stopped by ending
    exactly the processes of that cluster (`ray stop` would end every Ray instance of this
    user on the machine)."""
    temp_dir = tempfile.mkdtemp(prefix="bsray", dir="/tmp")  # short: unix socket paths
    port = free_port()
    env = {
        **os.environ,
        "RAY_ADDRESS": f"127.0.0.1:{port}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
        MARK: temp_dir,  # in every process of the cluster, so stop_cluster finds them all
    }
    common = ["--num-cpus=2", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    try:
        _ray(env, "start", "--head", f"--port={port}", "--include-dashboard=false",
             "--dashboard-port=0", f"--ray-client-server-port={free_port()}",
             '--resources={"HPU": 1, "prefill_node": 1}', *common)
        _ray(env, "start", f"--address=127.0.0.1:{port}",
             '--resources={"HPU": 1, "decode_node": 1}', *common)
        yield env
    finally:
        # Ray's GCS and autoscaler monitor ignore SIGTERM: a short grace, then SIGKILL
        stop_cluster(Path(temp_dir), grace_s=2.0)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_serve_joins_the_cluster_and_places_workers_by_resources(
    ray_cluster: dict[str, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    pinned = {"accelerator": "hpu", "torch_threads": 1}
    config = {
        "model": {"path": str(tiny_model_dir)},
        "kv_cache": {"block_size": 4, "num_blocks": 128},
        "controller": {
            "topology": "disaggregated",
            "prefill": {**pinned, "resources": {"prefill_node": 1}},
            "decode": {**pinned, "resources": {"decode_node": 1}},
        },
        "gateway": {"grpc_port": 0, "http_port": None, "drain_timeout_s": 1.0},
        "cluster": {"resources": {"HPU": 2}},
    }
    path, log = tmp_path / "serve.yaml", tmp_path / "serve.log"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "bucketserve.cli", "serve", "--config", str(path),
               "--ray-address", "auto"]
    with log.open("w") as err:
        proc = subprocess.Popen(command, env=ray_cluster, stdout=subprocess.PIPE, stderr=err,
                                text=True)
    try:
        assert_greedy_matches_in_process(grpc_target(proc, log), tiny_model_dir)
        placed = placement(ray_cluster)
        where = {cls: placed["nodes"][node] for cls, node in placed["actors"]}
        assert sorted(where) == ["DecodeWorker", "PrefillWorker"]
        assert "prefill_node" in where["PrefillWorker"]
        assert "decode_node" in where["DecodeWorker"]
    finally:
        ctrl_c(proc)


def _ray(env: dict[str, str], *args: str) -> None:
    done = subprocess.run([RAY, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"ray {args[0]} failed: {done.stderr[-2000:]}"
