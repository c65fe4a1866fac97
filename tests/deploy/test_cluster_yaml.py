"""The `ray up` recipes pass Ray's own cluster-config validation (broken copies do not), keep
Ray's dashboard on the head's loopback, run Ray with token auth, and install the Gaudi
software release their cards are supported by."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

DEPLOY = Path(__file__).resolve().parents[2] / "bucketserve" / "deploy"
AWS, ONPREM = DEPLOY / "cluster.yaml", DEPLOY / "cluster-onprem.yaml"
LOCAL = DEPLOY / "cluster-local.yaml"
CLUSTERS = sorted(DEPLOY.glob("cluster*.yaml"))
RAY_DEFAULT_PORTS = {6379, 8265, 10001, 52365}  # GCS, dashboard, client server, agent
RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default range for worker processes


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def ray_validate(config: dict[str, Any]) -> dict[str, Any]:
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_aws_gaudi_cluster_is_valid_with_a_dl1_worker_type_of_8_hpus() -> None:
    config = ray_validate(load(AWS))
    workers = config["available_node_types"]["gaudi"]
    assert workers["node_config"]["InstanceType"] == "dl1.24xlarge"
    assert workers["resources"] == {"HPU": 8}
    assert config["head_node_type"] == "head"
    assert config["available_node_types"]["head"]["resources"] == {}  # no card on the head
    setup = " ".join(config["worker_setup_commands"])
    assert "habanalabs-installer.sh install --type pytorch" in setup
    assert "pip install --no-deps -e ~/bucketserve" in setup
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])


def test_onprem_cluster_is_valid_with_its_host_list() -> None:
    raw = load(ONPREM)
    config = ray_validate(raw)
    assert config["provider"]["type"] == "local"
    workers = raw["provider"]["worker_ips"]
    node_type = config["available_node_types"][config["head_node_type"]]
    assert node_type["max_workers"] == len(workers) == 2
    assert any('"HPU": 8' in c for c in config["worker_start_ray_commands"])


def test_every_shipped_cluster_is_valid() -> None:
    assert [p.name for p in CLUSTERS] == [
        "cluster-local.yaml", "cluster-onprem.yaml", "cluster.yaml"
    ]
    for path in CLUSTERS:
        ray_validate(load(path))


def ray_starts(config: dict[str, Any]) -> list[str]:
    commands = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    return [" ".join(c.split()) for c in commands if "ray start" in c]


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_the_dashboard_listens_on_the_head_loopback_only(path: Path) -> None:
    heads = [c for c in ray_starts(load(path)) if "--head" in c]
    assert len(heads) == 1
    assert re.findall(r"--dashboard-host[= ](\S+)", heads[0]) == ["127.0.0.1"]


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_every_node_runs_ray_with_token_auth_and_the_token_file(path: Path) -> None:
    config = load(path)
    starts = ray_starts(config)
    assert starts and all("RAY_AUTH_MODE=token" in c for c in starts)
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_every_node_runs_workers_at_normal_priority(path: Path) -> None:
    """Ray's default worker niceness (15) lets daemons and the gateway preempt engines."""
    assert all("RAY_worker_niceness=0" in c for c in ray_starts(load(path)))


def gaudi_release(config: dict[str, Any]) -> str:
    setup = " ".join(config["setup_commands"] + config.get("worker_setup_commands", []))
    (release,) = set(re.findall(r"gaudi-installer/(\d+\.\d+)\.\d+/", setup))
    return release


def test_first_gen_gaudi_workers_install_the_last_release_that_supports_them() -> None:
    config = load(AWS)
    assert config["available_node_types"]["gaudi"]["node_config"]["InstanceType"].startswith(
        "dl1."
    )
    assert gaudi_release(config) == "1.21"


def test_the_onprem_gaudi_2_and_3_hosts_install_a_release_past_first_gen() -> None:
    major, minor = map(int, gaudi_release(load(ONPREM)).split("."))
    assert (major, minor) >= (1, 22)


def test_the_local_cluster_keeps_off_ray_default_ports_and_joins_its_own_head() -> None:
    config = load(LOCAL)
    (head,) = ray_starts(config)
    ports = {int(p) for p in re.findall(r"--[a-z-]*port=(\d+)", head)} - {0}  # 0: any free
    assert len(ports) == 3 and not ports & RAY_DEFAULT_PORTS
    assert not any(p in RAY_WORKER_PORTS for p in ports)
    assert "--dashboard-agent-listen-port=0" in head
    gcs_port = re.search(r"--port=(\d+)", head).group(1)
    assert config["provider"]["gcs_address"] == f"127.0.0.1:{gcs_port}"
    assert config["provider"]["module"] == "bucketserve.deploy.local_cluster.LocalClusterProvider"
    workers = config["available_node_types"]["gaudi"]
    assert workers["resources"]["HPU"] == 2 and workers["max_workers"] > workers["min_workers"]
    assert "HPU" not in config["available_node_types"]["head"]["resources"]


def _unknown_top_key(c: dict[str, Any]) -> None:
    c["max_worker"] = 2


def _unknown_node_type_key(c: dict[str, Any]) -> None:
    c["available_node_types"]["gaudi"]["instance_type"] = "dl1.24xlarge"


def _fractional_hpus(c: dict[str, Any]) -> None:
    c["available_node_types"]["gaudi"]["resources"]["HPU"] = 7.5


def _hpus_as_text(c: dict[str, Any]) -> None:
    c["available_node_types"]["gaudi"]["resources"]["HPU"] = "8"


def _head_type_not_listed(c: dict[str, Any]) -> None:
    c["head_node_type"] = "ray.head.gpu"


@pytest.mark.parametrize(
    ("breakage", "error", "message"),
    [
        (_unknown_top_key, jsonschema.ValidationError, "max_worker"),
        (_unknown_node_type_key, jsonschema.ValidationError, "instance_type"),
        (_fractional_hpus, jsonschema.ValidationError, "7.5 is not of type 'integer'"),
        (_hpus_as_text, jsonschema.ValidationError, "'8' is not of type 'integer'"),
        (_head_type_not_listed, ValueError, "head_node_type"),
    ],
    ids=["unknown key", "unknown node-type key", "HPU 7.5", "HPU '8'", "head type not listed"],
)
def test_broken_copies_of_the_aws_cluster_are_rejected(
    breakage: Callable[[dict[str, Any]], None], error: type[Exception], message: str
) -> None:
    config = load(AWS)
    breakage(config)
    with pytest.raises(error, match=message.replace("(", r"\(")):
        ray_validate(config)


def test_a_broken_onprem_cluster_is_rejected() -> None:
    config = load(ONPREM)
    config["provider"]["worker_ip"] = config["provider"].pop("worker_ips")
    with pytest.raises(click.ClickException, match="worker_ips"):  # Ray's cli_logger.abort
        ray_validate(config)
    config = load(ONPREM)
    config["setup_command"] = ["true"]
    with pytest.raises(jsonschema.ValidationError, match="setup_command"):
        ray_validate(config)
