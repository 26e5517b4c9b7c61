"""Every public module says what it offers (``__all__``), and says it truly: each listed name is
defined there, and each class or function it defines without a leading underscore is listed, so
``from module import *``, the docs and a reader see the same surface."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specrag"
PUBLIC_MODULES = sorted(
    path
    for path in PACKAGE.rglob("*.py")
    if not path.name.startswith("_") and "__pycache__" not in path.parts
)


def declared(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            return list(ast.literal_eval(node.value))
    return None


def defined(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(every name bound at the top level, the classes and functions among them)."""
    names: set[str] = set()
    definitions: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            definitions.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names | definitions, definitions


def test_there_are_public_modules_to_check() -> None:
    assert len(PUBLIC_MODULES) > 50


@pytest.mark.parametrize("path", PUBLIC_MODULES, ids=lambda path: str(path.relative_to(PACKAGE.parent)))
def test_a_public_module_lists_its_public_names_truly(path: Path) -> None:
    tree = ast.parse(path.read_text())
    listed = declared(tree)
    assert listed is not None, f"{path.name} has no __all__"
    names, definitions = defined(tree)
    assert not set(listed) - names, f"__all__ names what {path.name} does not define: {set(listed) - names}"
    unlisted = {name for name in definitions if not name.startswith("_")} - set(listed)
    assert not unlisted, f"{path.name} defines public {sorted(unlisted)} without listing them in __all__"
