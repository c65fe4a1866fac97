"""The `ray up` recipes pass Ray's own cluster-config validation; broken copies do not."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
AWS, ONPREM = DEPLOY / "cluster.yaml", DEPLOY / "cluster-onprem.yaml"


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
