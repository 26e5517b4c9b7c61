"""The tests' own layout (docs/architecture.md, "Tests"): fixtures live in conftest.py files, what
several test modules share lives in tests/helpers, and no file under tests/ imports a test module
or a conftest, so that a test file can change or go without breaking another. Read from the
source with ast: function-level and relative imports count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def module_of(path: Path) -> str:
    """The dotted name of the file ``path`` under the repository root."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def is_test_module(name: str) -> bool:
    """Whether the dotted ``name`` is a test module or a conftest under tests/."""
    last = name.rsplit(".", 1)[-1]
    return name.startswith("tests.") and (last.startswith("test_") or last == "conftest")


def imported_test_modules(text: str, module: str) -> list[str]:
    """The test modules and conftests the source ``text`` of the module ``module`` imports, relative
    imports resolved; ``from a import b`` counts ``a`` and ``a.b`` (``b`` may be a module)."""
    package = module.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(text, module)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            imported = ".".join([*base, *([node.module] if node.module else [])])
            names |= {imported, *(f"{imported}.{alias.name}" for alias in node.names)}
    return sorted(filter(is_test_module, names))


def test_no_file_under_tests_imports_a_test_module_or_a_conftest() -> None:
    sources = sorted(TESTS.rglob("*.py"))
    assert sum(source.name.startswith("test_") for source in sources) > 100  # the walk found them
    offending = {
        str(source.relative_to(ROOT)): imported
        for source in sources
        if (imported := imported_test_modules(source.read_text(), module_of(source)))
    }
    assert offending == {}, "move what they share into tests/helpers (fixtures into a conftest.py)"


@pytest.mark.parametrize(
    ("text", "module", "found"),
    [
        (
            "from tests.pipeline.test_kv_events import Publisher",
            "tests.pipeline.test_x",
            "tests.pipeline.test_kv_events",
        ),
        (
            "import tests.service.test_documents as documents",
            "tests.service.test_x",
            "tests.service.test_documents",
        ),
        (
            "from tests.pipeline import test_live_corpus",
            "tests.cache.test_x",
            "tests.pipeline.test_live_corpus",
        ),
        (
            "from .test_retried_flight import Launcher",
            "tests.controller.test_x",
            "tests.controller.test_retried_flight",
        ),
        ("from . import conftest", "tests.retrieval.pgvector.test_x", "tests.retrieval.pgvector.conftest"),
        ("from ..conftest import DIM", "tests.retrieval.pgvector.test_x", "tests.retrieval.conftest"),
        (
            "def f():\n    from tests.retrieval.conftest import DIM\n",
            "tests.test_x",
            "tests.retrieval.conftest",
        ),
    ],
)
def test_the_check_sees_every_way_of_importing_one(text: str, module: str, found: str) -> None:
    assert imported_test_modules(text, module) == [found]


def test_the_check_lets_the_helpers_and_the_product_through() -> None:
    text = (
        "from tests.helpers.live_corpus import text_corpus\n"
        "from tests.helpers import waiting\n"
        "from . import helpers\n"
        "import specrag.retrieval.corpus\n"
        "from specrag.testing import test_tools\n"
    )
    assert imported_test_modules(text, "tests.pipeline.test_x") == []
