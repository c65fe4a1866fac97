"""No recipe lets a node write core dumps: they would hold API keys, prompts and outputs
in files on disk."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "bucketserve" / "deploy"
RECIPES = sorted(DEPLOY.glob("*.yaml"))
CORE_LIMIT = re.compile(r"ulimit\s+(?:-\w*c\w*|--core-size)\s+(\w+)")


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_no_recipe_enables_core_dumps(path: Path) -> None:
    text = path.read_text()
    assert set(CORE_LIMIT.findall(text)) <= {"0"}, path.name
    assert "core_pattern" not in text and "LimitCORE" not in text


def test_the_onprem_cluster_turns_them_off_on_every_node() -> None:
    config = yaml.safe_load((DEPLOY / "cluster-onprem.yaml").read_text())
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    ray_starts = [c for c in starts if "ray start" in c]
    assert len(ray_starts) == 2
    assert all(c.startswith("ulimit -c 0;") for c in ray_starts)
