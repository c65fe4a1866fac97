"""The package layering of docs/architecture.md, enforced by import-linter's contracts in
pyproject.toml ([tool.importlinter]): imports go down the layers, bucket_manager and the
P/D scheduler never import torch, and no package has an import cycle among its modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_lint_imports_keeps_every_contract() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    out = subprocess.run(
        [str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Contracts: 3 kept, 0 broken." in out.stdout
