"""A rule of the settings' shape: every closed choice is a :class:`enum.StrEnum`, and product code
names its values through the Enum's members, never as string literals.

Read from the source (specrag/): the values of every ``StrEnum`` class are the choice values; outside
those classes no ``Literal[...]`` type may spell one, no comparison may test against one (``==``,
``!=``, ``is``, ``in`` a literal tuple, list or set), and no parameter or field typed with a choice
Enum may default to a bare string. The rule can fail: :func:`test_the_rule_finds_a_planted_choice`
plants each kind of mistake in a scrap of source and checks that the scan reports it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PRODUCT = Path(__file__).resolve().parents[1] / "specrag"


def _is_str_enum(node: ast.ClassDef) -> bool:
    return any(
        (isinstance(base, ast.Attribute) and base.attr == "StrEnum")
        or (isinstance(base, ast.Name) and base.id == "StrEnum")
        for base in node.bases
    )


def choice_enums(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Every StrEnum class of the sources, by name, with its values."""
    enums: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and _is_str_enum(node):
                enums[node.name] = {
                    statement.value.value
                    for statement in node.body
                    if isinstance(statement, ast.Assign)
                    and isinstance(statement.value, ast.Constant)
                    and isinstance(statement.value.value, str)
                }
    return enums


def _strings(node: ast.AST) -> Iterator[str]:
    for child in ast.walk(node):
        if isinstance(child, ast.Constant) and isinstance(child.value, str):
            yield child.value


def _names(node: ast.AST | None) -> set[str]:
    if node is None:
        return set()
    found = {child.id for child in ast.walk(node) if isinstance(child, ast.Name)}
    found |= {child.attr for child in ast.walk(node) if isinstance(child, ast.Attribute)}
    found |= set(_strings(node))  # annotations are strings under ``from __future__ import annotations``
    return found


def violations(trees: dict[str, ast.Module], enums: dict[str, set[str]]) -> list[str]:
    """Where a choice value is spelled as a string outside its Enum (file:line and what)."""
    values = set().union(*enums.values()) if enums else set()
    found: list[str] = []
    for path, tree in trees.items():
        inside_enums = {
            id(child)
            for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and _is_str_enum(node)
            for child in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in inside_enums:
                continue
            where = f"{path}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Subscript) and "Literal" in _names(node.value):
                spelled = set(_strings(node.slice)) & values
                if spelled:
                    found.append(f"{where} Literal of choice values {sorted(spelled)}")
            elif isinstance(node, ast.Compare):
                for operator, right in zip(node.ops, node.comparators, strict=True):
                    sides = [node.left, right]
                    if isinstance(operator, ast.Eq | ast.NotEq | ast.Is | ast.IsNot):
                        spelled = {
                            side.value
                            for side in sides
                            if isinstance(side, ast.Constant) and side.value in values
                        }
                    elif isinstance(operator, ast.In | ast.NotIn) and isinstance(
                        right, ast.Tuple | ast.List | ast.Set
                    ):
                        spelled = {
                            element.value
                            for element in right.elts
                            if isinstance(element, ast.Constant) and element.value in values
                        }
                    else:
                        spelled = set()
                    if spelled:
                        found.append(f"{where} comparison with choice values {sorted(spelled)}")
            elif isinstance(node, ast.AnnAssign) and _names(node.annotation) & enums.keys():
                if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                    found.append(f"{where} a choice field defaults to the string {node.value.value!r}")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                arguments = node.args
                positional = [*arguments.posonlyargs, *arguments.args]
                defaulted = positional[len(positional) - len(arguments.defaults) :]
                pairs = [
                    *zip(defaulted, arguments.defaults, strict=True),
                    *zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True),
                ]
                for argument, default in pairs:
                    if (
                        isinstance(default, ast.Constant)
                        and isinstance(default.value, str)
                        and _names(argument.annotation) & enums.keys()
                    ):
                        found.append(f"{where} {argument.arg} defaults to the string {default.value!r}")
    return found


def product_trees() -> dict[str, ast.Module]:
    return {
        str(path.relative_to(PRODUCT.parent)): ast.parse(path.read_text(), str(path))
        for path in sorted(PRODUCT.rglob("*.py"))
    }


def test_the_closed_choices_are_enums() -> None:
    enums = choice_enums(product_trees())
    expected = {
        "ModeName",
        "DocumentKv",
        "SpeculationSetting",
        "PrefillOrder",
        "Schedule",
        "PolicyName",
        "Router",
    }
    assert expected <= enums.keys()
    assert enums["SpeculationSetting"] == {"auto", "always", "never"}


def test_no_choice_value_is_spelled_outside_its_enum() -> None:
    trees = product_trees()
    assert violations(trees, choice_enums(trees)) == []


PLANTED = """
import enum
from typing import Literal

class Colour(enum.StrEnum):
    RED = "red"
    BLUE = "blue"

Hue = Literal["red", "green"]

def paint(colour: Colour = "red", *, other: "Colour" = "blue") -> None:
    if colour == "blue" or colour in ("red", "pink"):
        pass

class Settings:
    colour: Colour = "red"
    name: str = "red"
"""


def test_the_rule_finds_a_planted_choice() -> None:
    trees = {"planted.py": ast.parse(PLANTED)}
    found = violations(trees, choice_enums(trees))
    assert sorted(line.split(" ", 1)[1] for line in found) == [
        "Literal of choice values ['red']",
        "a choice field defaults to the string 'red'",
        "colour defaults to the string 'red'",
        "comparison with choice values ['blue']",
        "comparison with choice values ['red']",
        "other defaults to the string 'blue'",
    ]
