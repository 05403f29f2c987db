"""Imports that run against the layering (issue #19): each package below may not reach the one named.

Every import in the file counts, also those inside functions (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "conveyor"

# (modules under this prefix, may not import this module or anything under it, why)
FORBIDDEN = [
    ("conveyor.kernels", "conveyor.config", "kernels take their settings as arguments; callers read the environment"),
    ("conveyor.bench", "conveyor.server", "benchmarks drive a server they are given (HTTP), never start one"),
    ("conveyor.server", "conveyor.cluster", "role dispatch is the top-level CLI's (conveyor/cli.py)"),
    ("conveyor.structured", "conveyor.engine", "structured output sits below the engine; errors live in conveyor.errors"),
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


MODULES = {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


@pytest.mark.parametrize(("layer", "target", "why"), FORBIDDEN, ids=[f"{a}-x->{b}" for a, b, _ in FORBIDDEN])
def test_no_import_against_the_layering(layer, target, why):
    offenders = sorted(f"{module} imports {name}" for module, names in MODULES.items() if _under(module, layer)
                       for name in names if _under(name, target))
    assert not offenders, f"{why}: {offenders}"


def test_the_check_sees_lazy_imports():
    assert "conveyor.cluster.serve" in MODULES["conveyor.cli"]  # imported inside _run_serve
