"""The dependency direction (docs/architecture.md), read from the source: service -> controller -> pipeline ->
cache, retrieval; the leaf modules (atomic, errors, paths) serve everyone; the client needs only
errors. Function-level imports count too: an import that runs back up is one, wherever it sits."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specrag"
LEAVES = {"atomic", "errors", "paths"}
ALLOWED = {
    "cache": LEAVES | {"cache"},
    "retrieval": LEAVES | {"retrieval"},
    "pipeline": LEAVES | {"pipeline", "cache", "retrieval"},
    "controller": LEAVES | {"controller", "pipeline", "cache", "retrieval"},
}


def imported_parts(source: Path) -> set[str]:
    """The first component under ``specrag`` of every module this file imports."""
    parts: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        parts |= {name.split(".")[1] for name in names if name.startswith("specrag.")}
    return parts


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_what_lies_below_it(package: str) -> None:
    sources = sorted((PACKAGE / package).rglob("*.py"))
    assert sources
    wrong = {
        str(source.relative_to(PACKAGE)): sorted(imported_parts(source) - ALLOWED[package])
        for source in sources
    }
    assert {name: parts for name, parts in wrong.items() if parts} == {}


def test_the_client_imports_only_errors() -> None:
    assert imported_parts(PACKAGE / "client.py") == {"errors"}
