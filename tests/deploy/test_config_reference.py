"""docs/configuration.md is generated from the settings models, and serve.yaml shows every key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from bucketserve import envs
from bucketserve.deploy.config_reference import key_paths, render

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "bucketserve config reference > docs/configuration.md"


def test_docs_configuration_md_is_the_generated_reference() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert text == render(), f"docs/configuration.md is stale: run `{REGENERATE}`"


def test_the_reference_lists_every_key_and_every_environment_variable() -> None:
    text = render()
    for path in key_paths():
        assert f"| `{path}` |" in text
    for name in envs.VARIABLES:
        assert f"| `{name}` |" in text
    assert "controller.decode.slo_hold_fraction" not in text and "buckets.lookup" not in text


def test_the_cli_prints_the_reference() -> None:
    run = [sys.executable, "-m", "bucketserve.cli", "config", "reference"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout == render()


MAPPING_VALUES = {
    "controller.prefill.resources", "controller.decode.resources", "cluster.resources"
}


def _keys(data: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in data.items():
        path = f"{prefix}{key}"
        if path == "tenants":
            keys = keys.union(*(_keys(entry, "tenants[].") for entry in value))
        elif isinstance(value, dict) and path not in MAPPING_VALUES:
            keys |= _keys(value, f"{path}.")
        else:
            keys.add(path)
    return keys


def test_serve_yaml_shows_every_key() -> None:
    """Every key in the example (its tenants together); the shape ranges and plaintext keys,
    which the example leaves out, in its comments."""
    path = ROOT / "bucketserve" / "deploy" / "serve.yaml"
    text = path.read_text()
    shown = _keys(yaml.safe_load(text))
    reference = set(key_paths())
    assert shown <= reference, shown - reference
    commented = {
        "buckets.prompt.bs", "buckets.prompt.query", "buckets.prompt.ctx",
        "buckets.decode.bs", "buckets.decode.blocks", "tenants[].api_keys",
    }
    assert reference - shown == commented
    for key in commented:
        leaf = key.rsplit(".", 1)[-1]
        assert f"{leaf}:" in text or f"`{leaf}`" in text, key  # in a comment
