"""What a searcher can do is part of its contract: declared, checked once when an index opens it, and
never asked of its class by the index facade."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.local.staged_hnsw import StagedHNSW
from specrag.retrieval.backends.local.staged_ivf import StagedIVF
from specrag.retrieval.backends.shards.build import build_ivf_shards
from specrag.retrieval.backends.shards.merge import ShardAnswers
from specrag.retrieval.index.searcher import OpenedSearcher
from specrag.retrieval.search.stages import Capabilities, StagePlan, StageResult
from specrag.retrieval.vector_index import VectorIndex

RETRIEVAL = Path(__file__).resolve().parents[2] / "specrag" / "retrieval"
FACADE = [RETRIEVAL / "vector_index.py", *sorted((RETRIEVAL / "index").glob("*.py"))]
CAPABILITY_PROTOCOLS = {"Growable", "Retrainable", "RanksText", "AnswersPartially"}
CLASS_TESTS = {"isinstance", "issubclass"}
ATTRIBUTE_TESTS = {"getattr", "hasattr", "type"}


def backend_classes() -> set[str]:
    """Every class a backend defines (its searchers among them)."""
    return {
        node.name
        for source in (RETRIEVAL / "backends").rglob("*.py")
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.ClassDef)
    }


def calls_by_function(source: Path) -> Iterator[tuple[str, ast.Call]]:
    """Each call in ``source`` with the name of the function it sits in ("" at module level)."""

    def visit(node: ast.AST, function: str) -> Iterator[tuple[str, ast.Call]]:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.Call):
                yield function, child
            yield from visit(child, inner)

    yield from visit(ast.parse(source.read_text()), "")


def named(node: ast.AST) -> set[str]:
    """The names (and attribute names) an expression mentions."""
    return {
        part.id if isinstance(part, ast.Name) else part.attr
        for part in ast.walk(node)
        if isinstance(part, ast.Name | ast.Attribute)
    }


def test_the_index_facade_never_tests_its_searchers_class() -> None:
    """No backend class is named in a class test, no attribute is probed, and the capability
    protocols are tested only where a searcher is opened (``OpenedSearcher.of``)."""
    assert (RETRIEVAL / "index" / "searcher.py") in FACADE
    backends = backend_classes()
    assert {"StagedIVF", "StagedHNSW", "ShardedSearcher", "PgVectorSearcher"} <= backends
    found = []
    for source in FACADE:
        for function, call in calls_by_function(source):
            callee = call.func.id if isinstance(call.func, ast.Name) else ""
            where = f"{source.name}:{call.lineno} in {function or 'the module'}"
            if callee in ATTRIBUTE_TESTS:
                found.append(f"{where}: {callee}()")
            elif callee in CLASS_TESTS and len(call.args) == 2:
                tested = named(call.args[1])
                if tested & backends or (tested & CAPABILITY_PROTOCOLS and function != "of"):
                    found.append(f"{where}: {callee}(..., {', '.join(sorted(tested))})")
    assert found == []


class PlainSearcher:
    """A searcher of three rows that searches and nothing more, declaring what it is told to."""

    kind = "plain"
    owner: Any = None
    dim = 2
    ntotal = 3

    def __init__(self, capabilities: Capabilities) -> None:
        self.capabilities = capabilities
        self.settings: dict[str, Any] = {"kind": self.kind}

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.tile(np.arange(k) % self.ntotal, (len(queries), 1))
        return np.zeros(ids.shape, dtype=np.float32), ids

    def stages(self, queries: np.ndarray, k: int, plan: StagePlan) -> Iterator[StageResult]:
        distances, ids = self.search(queries, k)
        yield StageResult(1, ids, distances, True, 0.0)


class BlindGrower(PlainSearcher):
    """Takes rows, but its searches take no visibility: it cannot skip the rows an index hides."""

    next_row = 3

    def add(self, vectors: np.ndarray, first_row: int) -> None: ...

    def compacted(self, keep: np.ndarray) -> BlindGrower:
        return self

    def stored_vectors(self, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(0, dtype=np.int64), np.zeros((0, self.dim), dtype=np.float32)


def test_a_searcher_whose_searches_take_no_visibility_cannot_declare_live_rows() -> None:
    with pytest.raises(InvalidInputError, match=r"declares live_rows but lacks .* given a visibility"):
        VectorIndex(BlindGrower(Capabilities(live_rows=True)), ["a", "b", "c"])


@pytest.mark.parametrize(
    ("declared", "named_in_error"),
    [
        (Capabilities(live_rows=True), "live_rows"),
        (Capabilities(live_rows=True, retrains=True), "live_rows"),
        (Capabilities(retrains=True), "retrains or snapshot_rows"),
        (Capabilities(snapshot_rows=True), "retrains or snapshot_rows"),
        (Capabilities(ranks_text=True), "ranks_text"),
        (Capabilities(partial_answers=True), "partial_answers"),
    ],
)
def test_a_searcher_declaring_what_it_lacks_is_refused_when_opened(
    declared: Capabilities, named_in_error: str
) -> None:
    with pytest.raises(InvalidInputError, match=f"the plain searcher declares {named_in_error} but lacks"):
        VectorIndex(PlainSearcher(declared), ["a", "b", "c"])
    index = VectorIndex(PlainSearcher(Capabilities()), ["a", "b", "c"])
    with pytest.raises(InvalidInputError, match=f"declares {named_in_error} but lacks"):
        index.searcher = PlainSearcher(declared)


def test_every_local_searcher_opens_with_what_it_declares(
    ivf: StagedIVF, hnsw: StagedHNSW, vectors: np.ndarray
) -> None:
    opened_ivf, opened_hnsw = OpenedSearcher.of(ivf), OpenedSearcher.of(hnsw)
    assert opened_ivf.live is ivf and opened_ivf.retrainable is ivf and opened_ivf.partial is None
    assert opened_hnsw.live is hnsw and opened_hnsw.retrainable is None and opened_hnsw.text is None
    sharded = build_ivf_shards(vectors[:1200], 2, nlist=16, nprobe=8)
    opened = OpenedSearcher.of(sharded)
    assert opened.partial is sharded and opened.live is sharded and opened.retrainable is None


def test_a_searcher_swapped_in_answers_as_its_capabilities_say(
    vectors: np.ndarray, queries: np.ndarray
) -> None:
    """As a sharded service swaps its shards in: the index opens the new searcher, so a search
    that accepts a partial answer hears from its shards, and not from the one it held before."""
    rows = vectors[:1200]
    index = VectorIndex(StagedIVF.build(rows, nlist=16, nprobe=8), [f"p{row}" for row in range(len(rows))])
    before = ShardAnswers()
    index.search(queries[0], 5, shard_answers=before)
    assert before.answered == []
    index.searcher = build_ivf_shards(rows, 3, nlist=16, nprobe=8)
    answers, staged = ShardAnswers(), ShardAnswers()
    index.search(queries[0], 5, shard_answers=answers)
    list(index.search_staged(queries[0], 5, StagePlan(2, "equal"), shard_answers=staged))
    assert answers.answered == staged.answered == ["000", "001", "002"]


def test_a_searcher_searched_through_for_a_block_is_opened_and_given_back(
    vectors: np.ndarray, queries: np.ndarray
) -> None:
    """The swap a sharded service makes is the facade's one named operation: the searcher is
    opened (its capabilities checked) and must hold the index's rows; the one held before comes
    back on exit, also when the block fails."""
    rows = vectors[:1200]
    local = StagedIVF.build(rows, nlist=16, nprobe=8)
    index = VectorIndex(local, [f"p{row}" for row in range(len(rows))])
    sharded = build_ivf_shards(rows, 3, nlist=16, nprobe=8)
    with index.searching_through(sharded):
        assert index.searcher is sharded and index.retrainable is None
        answers = ShardAnswers()
        index.search(queries[0], 5, shard_answers=answers)
        assert answers.answered == ["000", "001", "002"]
    assert index.searcher is local and index.retrainable is local
    with pytest.raises(RuntimeError, match="the block failed"), index.searching_through(sharded):
        raise RuntimeError("the block failed")
    assert index.searcher is local
    with pytest.raises(InvalidInputError, match="holds 600 rows, the index 1200"):
        index.searching_through(build_ivf_shards(rows[:600], 2, nlist=16, nprobe=8)).__enter__()
    assert index.searcher is local
    plain = PlainSearcher(Capabilities())
    three = VectorIndex(plain, ["a", "b", "c"])
    with pytest.raises(InvalidInputError, match="declares live_rows but lacks"):
        three.searching_through(BlindGrower(Capabilities(live_rows=True))).__enter__()
    assert three.searcher is plain


def test_no_module_outside_the_backends_tests_a_searchers_class_or_capability() -> None:
    """Outside ``retrieval/backends`` (whose modules know their own classes) and the facade's
    opening, what a searcher can do is asked of the index (``VectorIndex.retrainable``, ...)."""
    backends = backend_classes()
    outside = [
        source
        for source in (RETRIEVAL.parent).rglob("*.py")
        if RETRIEVAL / "backends" not in source.parents and source != RETRIEVAL / "index" / "searcher.py"
    ]
    found = []
    for source in outside:
        for function, call in calls_by_function(source):
            callee = call.func.id if isinstance(call.func, ast.Name) else ""
            if callee in CLASS_TESTS and len(call.args) == 2:
                tested = named(call.args[1]) & (backends | CAPABILITY_PROTOCOLS)
                if tested:
                    found.append(f"{source.relative_to(RETRIEVAL.parent)} in {function}: {sorted(tested)}")
    assert found == []
