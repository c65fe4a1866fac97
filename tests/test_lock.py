"""requirements/lock.txt pins what pyproject.toml asks for, and this venv holds exactly it.

`make setup` installs the lock with `--no-deps`, so a package the lock lacks is missing
rather than resolved anew, and one it holds that nothing needs is dead weight: both fail
here until `make lock` is run.
"""

from __future__ import annotations

import platform
import sys
import sysconfig
import tomllib
from collections import deque
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"


def requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def locked() -> dict[NormalizedName, Version]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            name, version = line.split(" ", 1)[0].split("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def roots() -> list[Requirement]:
    """What `make lock` resolves: the project with its `test` extra, and setup.in."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = project["dependencies"] + project["optional-dependencies"]["test"]
    listed += requirement_lines(ROOT / "requirements" / "setup.in")
    return [Requirement(line) for line in listed]


def dropped() -> set[NormalizedName]:
    """Packages requirements/overrides.txt removes (a marker no machine meets)."""
    return {
        canonicalize_name(Requirement(line).name)
        for line in requirement_lines(ROOT / "requirements" / "overrides.txt")
    }


def test_every_requirement_is_pinned_inside_its_range() -> None:
    pins = locked()
    constraints = [Requirement(line) for line in requirement_lines(ROOT / "constraints.txt")]
    for req in roots() + constraints:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not in {LOCK.name}: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{LOCK.name} pins {name}=={pins[name]}, outside {req}: run `make lock`"
        )


def test_requirements_are_not_pinned_in_pyproject() -> None:
    """pyproject.toml keeps the ranges a library user needs; exact pins live in the lock."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        assert "==" not in line, f"pin {line!r} in requirements/, not in pyproject.toml"


on_lock_platform = pytest.mark.skipif(
    sys.version_info[:2] != (3, 11) or platform.machine() != "x86_64",
    reason="the lock is for CPython 3.11 on x86-64 Linux; elsewhere pyproject's ranges install",
)


@on_lock_platform
def test_installed_packages_are_the_lock() -> None:
    """The drift check: nothing in this venv was resolved outside the lock."""
    # site-packages alone: importing setuptools puts its vendored copies on sys.path
    paths = list(dict.fromkeys(sysconfig.get_path(key) for key in ("purelib", "platlib")))
    installed = {
        canonicalize_name(dist.metadata["Name"]): Version(dist.version)
        for dist in metadata.distributions(path=paths)
    }
    installed.pop(canonicalize_name("bucketserve"))
    pins = locked()
    missing = {name: str(v) for name, v in pins.items() if installed.get(name) != v}
    extra = {name: str(v) for name, v in installed.items() if pins.get(name) != v}
    assert (missing, extra) == ({}, {}), "rerun `make setup` (or `make lock` after a change)"


@on_lock_platform
def test_lock_holds_what_the_roots_need_and_nothing_else() -> None:
    """The roots' closure over the installed metadata is exactly the lock's packages."""
    skip = dropped()
    seen: set[tuple[NormalizedName, str]] = set()
    todo = deque(
        (canonicalize_name(req.name), extra) for req in roots() for extra in ("", *req.extras)
    )
    while todo:
        name, extra = todo.popleft()
        if name in skip or (name, extra) in seen:
            continue
        seen.add((name, extra))
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            requires = []  # not installed: test_installed_packages_are_the_lock says so
        for dep in map(Requirement, requires):
            if dep.marker is None or dep.marker.evaluate({"extra": extra}):
                todo.extend((canonicalize_name(dep.name), e) for e in ("", *dep.extras))
    needed, pins = {name for name, _ in seen}, set(locked())
    assert needed == pins, f"unneeded: {sorted(pins - needed)}; unlocked: {sorted(needed - pins)}"
