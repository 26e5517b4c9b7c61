"""A rule of the query core's shape: no function in specrag/controller/ takes more than five
parameters besides ``self``; a step that needs more belongs on the query's run object."""

from __future__ import annotations

import ast
from pathlib import Path

CONTROLLER = Path(__file__).resolve().parents[2] / "specrag" / "controller"
MAX_PARAMETERS = 5


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    arguments = function.args
    names = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
    names += [a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def test_no_controller_function_takes_more_than_five_parameters() -> None:
    sources = sorted(CONTROLLER.glob("*.py"))
    assert sources
    too_many = [
        f"{source.name}:{node.lineno} {node.name}"
        for source in sources
        for node in ast.walk(ast.parse(source.read_text(), str(source)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and len(parameters(node)) > MAX_PARAMETERS
    ]
    assert too_many == []
