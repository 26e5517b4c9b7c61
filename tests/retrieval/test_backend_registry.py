"""The backend registry (:mod:`specrag.retrieval.backends.registry`): the only place that names a
backend, where the command line's choices come from, and where a combination a backend refuses
fails before any file, database or engine is touched."""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from specrag.cli import build_parser, main
from specrag.errors import InvalidInputError
from specrag.paths import DataLayout
from specrag.retrieval.backends import registry
from specrag.retrieval.backends.contract import Fit, Flags, OpenedSearcher
from specrag.retrieval.backends.local.staged_ivf import StagedIVF
from specrag.retrieval.backends.registry import BACKENDS, chosen, searched, stores
from specrag.retrieval.corpus import Passage
from specrag.retrieval.embedders.embedder import Embedder
from specrag.retrieval.index_store import TFIDF_SVD
from specrag.retrieval.lexical.bm25 import LexicalIndex
from specrag.retrieval.search.stages import StagedSearcher
from specrag.service.cli import commands
from specrag.service.run.assets import ensure_assets

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
    choices = ", ".join(repr(name) for name in stores())
    assert f"invalid choice: 'nowhere' (choose from {choices})" in capsys.readouterr().err
    assert set(stores()) == {backend.stores for backend in BACKENDS}


def test_no_module_outside_the_registry_tests_which_backend_was_chosen() -> None:
    """No comparison of a backend flag with a backend's name outside ``retrieval/backends/``: a
    new backend would otherwise need an edit wherever one stands."""
    names = {backend.name for backend in BACKENDS} | set(stores())
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


@dataclass
class _MemoryTable:
    """A throwaway backend's opened searcher: its rows are a few passages held in memory."""

    passages: list[Passage]
    embedder: Embedder
    searcher: StagedIVF
    lexical: LexicalIndex | None = None
    store_name: str | None = "memory"
    table: StagedSearcher | None = None
    documents_off: str | None = None

    def close(self) -> None: ...

    def health(self, bound_s: float) -> dict[str, Any] | None:
        return {"serving": True, "rows": self.searcher.ntotal}


def test_a_backend_registered_once_is_reached_from_the_command_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_dir: Path, default_corpus: list[Passage]
) -> None:
    """docs/architecture.md: adding a backend is a folder of its own and one registration in
    ``BACKENDS``. A backend defined here and registered there alone is offered by ``--backend``,
    chosen by the lookup, and opened by the service's assets, no other module edited."""
    passages = default_corpus[:24]
    opened: list[_MemoryTable] = []

    def settings(args: argparse.Namespace, building: bool) -> str:
        if args.memory_rows < 1:
            raise InvalidInputError(f"--memory-rows must be at least 1, got {args.memory_rows}")
        return "memory"

    def add_arguments(parser: Flags, building: bool) -> None:
        parser.add_argument("--memory-rows", type=int, default=len(passages))

    def open_searcher(chosen_settings: str, fit: Fit) -> OpenedSearcher:
        embedder = fit(TFIDF_SVD, [passage.text for passage in passages])
        vectors = embedder.embed([passage.text for passage in passages])
        opened.append(_MemoryTable(passages, embedder, StagedIVF.build(vectors, nlist=2, nprobe=2)))
        return opened[-1]

    def load(*args: object) -> str:
        raise AssertionError("not built here")

    memory = searched("memory", "memory", add_arguments, settings, load, open_searcher)
    monkeypatch.setattr(registry, "BACKENDS", (*registry.BACKENDS, memory))
    with pytest.raises(InvalidInputError, match="--memory-rows must be at least 1"):
        chosen(parse("serve", "--backend", "memory", "--memory-rows", "0"))
    backend = chosen(parse("serve", "--backend", "memory"))
    assert backend.name == "memory"
    assets = ensure_assets(DataLayout(tmp_path / "data"), tiny_model_dir, backend=backend)
    try:
        assert assets.index.searcher is opened[0].searcher and assets.passages == passages
        assert assets.opened is not None and assets.opened.health(1.0) == {"serving": True, "rows": 24}
        top = assets.index.search(assets.index.embed_query(passages[3].text), 1)[1]
        assert assets.index.passage_ids_of(top) == [passages[3].id]
    finally:
        if assets.corpus is not None:
            assets.corpus.store.stop_writing()
