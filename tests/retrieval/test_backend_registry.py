"""The backend registry (:mod:`specrag.retrieval.backends.registry`): the only place that names a
backend, where the command line's choices come from, and where a combination a backend refuses
fails before any file, database or engine is touched."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from specrag.cli import build_parser, main
from specrag.retrieval.backends.registry import BACKENDS, STORES, chosen
from specrag.service.cli import commands

PACKAGE = Path(__file__).resolve().parents[2] / "specrag"
NOBODY = "postgresql://nobody@127.0.0.1:1/none"  # never reached: the refusals come first


def parse(*line: str) -> argparse.Namespace:
    return build_parser().parse_args(list(line))


@pytest.mark.parametrize("command", [("serve",), ("index", "build")])
def test_the_backend_choices_of_each_command_are_the_registrys(
    command: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse(*command, "--backend", "nowhere")
    choices = ", ".join(repr(name) for name in STORES)
    assert f"invalid choice: 'nowhere' (choose from {choices})" in capsys.readouterr().err
    assert set(STORES) == {backend.stores for backend in BACKENDS}


def test_no_module_outside_the_registry_tests_which_backend_was_chosen() -> None:
    """No comparison of a backend flag with a backend's name outside ``retrieval/backends/``: a
    new backend would otherwise need an edit wherever one stands."""
    names = {backend.name for backend in BACKENDS} | set(STORES)
    found = []
    for source in sorted(PACKAGE.rglob("*.py")):
        if source.is_relative_to(PACKAGE / "retrieval" / "backends"):
            continue
        text = source.read_text()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            named = any(isinstance(part, ast.Constant) and part.value in names for part in operands)
            if named and "backend" in (ast.get_source_segment(text, node) or ""):
                found.append(f"{source.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []


def test_the_lookup_picks_the_backend_the_flags_describe() -> None:
    assert chosen(parse("serve")).name == "local"
    assert chosen(parse("serve", "--ray", "--search-shards", "2")).name == "shards"
    assert chosen(parse("serve", "--backend", "pgvector", "--pg-dsn", NOBODY)).name == "pgvector"
    assert chosen(parse("prepare")).name == "local"  # no --backend: the data directory's index
    assert chosen(parse("index", "build"), building=True).name == "local"
    assert chosen(parse("index", "build", "--shards", "3"), building=True).name == "shards"


def test_a_sharded_table_build_is_refused_before_anything_is_touched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = ["--data-dir", str(tmp_path), "index", "build", "--backend", "pgvector", "--shards", "2"]
    assert main([*line, "--pg-dsn", NOBODY]) == 2
    error = capsys.readouterr().err
    assert "--shards 2" in error and "--backend pgvector" in error and "scales itself" in error
    assert list(tmp_path.iterdir()) == []  # no default corpus written, no database asked


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--corpus", "passages.jsonl"], "--corpus: with --backend pgvector the table's rows are the corpus"),
        (["--embedder", "openai"], "--embedder openai needs --embedder-url URL and --embedder-model NAME"),
        (["--ray", "--search-shards", "2"], "--backend pgvector searches the database's table"),
    ],
)
def test_serve_refuses_what_the_table_cannot_do_before_binding_or_importing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    extra: list[str],
    said: str,
) -> None:
    def touched(*args: object, **kwargs: object) -> None:
        raise AssertionError("serve started before the backend's refusal")

    monkeypatch.setattr(commands, "start_imports", touched)
    monkeypatch.setattr(commands, "bind_listener", touched)
    line = ["--data-dir", str(tmp_path), "serve", "--port", "0", "--backend", "pgvector"]
    assert main([*line, "--pg-dsn", NOBODY, *extra]) == 2
    assert said in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
