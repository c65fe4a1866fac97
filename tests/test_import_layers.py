"""The package layering of docs/architecture.md, enforced by import-linter's contracts in
pyproject.toml ([tool.importlinter]): imports go down the service's layers and the runtime's
rooms, the gateway and SDK import no worker, bookkeeping never imports torch, and no package
has an import cycle among its modules."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_lint_imports_keeps_every_contract() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    out = subprocess.run(
        [str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert f"Contracts: {len(contracts['contracts'])} kept, 0 broken." in out.stdout
