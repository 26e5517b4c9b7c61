"""PostgreSQL's full-text search as the lexical channel of a pgvector table, on a real server."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import psycopg
import pytest

from specrag.cli import build_parser
from specrag.errors import InvalidInputError
from specrag.retrieval.backends.pgvector.backend import serve_settings
from specrag.retrieval.backends.pgvector.config import PgServing, PgSettings, StageMode
from specrag.retrieval.backends.pgvector.database import Database
from specrag.retrieval.backends.pgvector.local_server import LocalPostgres
from specrag.retrieval.backends.pgvector.searcher import PgVectorSearcher
from specrag.retrieval.backends.pgvector.table import inspect_table, load_table, read_passages
from specrag.retrieval.corpus import Passage
from specrag.retrieval.live_index import Visibility
from specrag.retrieval.search.stages import StagePlan
from tests.helpers.live_corpus import TableEmbedder
from tests.helpers.tables import table_index
from tests.helpers.vectors import DIM

ROWS = 600
# Rows whose text holds the rare word; no other row's does.
MARKED = set(range(0, ROWS, 50))
WORD = "zebra"
DEPTH = 100
PLAN = StagePlan(6, "geometric")


def marked_passages() -> list[Passage]:
    return [
        Passage(
            f"p{row:05d}",
            f"title {row}",
            f"text of passage {row}" + (f" about a {WORD}" if row in MARKED else ""),
        )
        for row in range(ROWS)
    ]


@pytest.fixture
def table(postgres: LocalPostgres, vectors: np.ndarray) -> PgSettings:
    """A fresh table for each test: some write to it."""
    settings = PgSettings(postgres.dsn, table="fulltext_rows")
    load_table(settings, marked_passages(), vectors[:ROWS], nlist=20, replace=True)
    return settings


def open_searcher(settings: PgSettings, mode: StageMode = StageMode.PARALLEL) -> PgVectorSearcher:
    database = Database(settings)
    layout = inspect_table(database, DIM)
    ids = [passage.id for passage in read_passages(database)]
    return PgVectorSearcher(database, layout, ids, nprobe=8, mode=mode, fulltext=True)


def every_row_shown(rows: int = ROWS) -> Visibility:
    return Visibility(np.concatenate([np.arange(rows), [-1]]), 0)


def ranked_rows(ranking: np.ndarray) -> set[int]:
    return {int(row) for row in ranking if row >= 0}


@pytest.fixture
def searcher(table: PgSettings) -> Iterator[PgVectorSearcher]:
    opened = open_searcher(table)
    yield opened
    opened.close()


def test_the_rows_whose_text_matches_are_ranked(searcher: PgVectorSearcher, vectors: np.ndarray) -> None:
    _, _, ranked = searcher.search_text(
        vectors[:2], 10, [f"a {WORD}?", "text of nothing"], DEPTH, every_row_shown()
    )
    assert ranked_rows(ranked[0]) == MARKED
    assert len(ranked_rows(ranked[1])) == DEPTH  # "text" is in every row: the depth cuts it


def test_a_hidden_version_is_not_ranked(searcher: PgVectorSearcher, vectors: np.ndarray) -> None:
    shown = every_row_shown()
    hidden = Visibility(np.where(np.isin(np.arange(ROWS + 1), [50, ROWS]), -1, shown.row_to_passage), 1)
    _, _, ranked = searcher.search_text(vectors[:1], 10, [WORD], DEPTH, hidden)
    assert ranked_rows(ranked[0]) == MARKED - {50}


@pytest.mark.parametrize("mode", list(StageMode), ids=str)
def test_the_ranking_reads_the_stages_snapshot(
    table: PgSettings, vectors: np.ndarray, mode: StageMode
) -> None:
    searcher = open_searcher(table, mode)
    update = f"UPDATE {table.table} SET text = text || ' and a {WORD}' WHERE id = 'p00007'"
    try:
        with psycopg.connect(table.dsn) as writer:
            writer.execute(update)  # not committed yet
            _, _, ranked = searcher.search_text(vectors[:1], 10, [WORD], DEPTH, every_row_shown())
            assert ranked_rows(ranked[0]) == MARKED
            stages = searcher.stages_text(vectors[:1], 10, [WORD], DEPTH, PLAN, every_row_shown())
            seen = [next(stages)]
            writer.commit()  # after the search's snapshot was taken
            seen += list(stages)
        rankings = [ranked_rows(ranking[0]) for _, ranking in seen if ranking is not None]
        assert seen[0][1] is not None and seen[-1][0].done
        assert all(ranking == MARKED for ranking in rankings)
        _, _, ranked = searcher.search_text(vectors[:1], 10, [WORD], DEPTH, every_row_shown())
        assert ranked_rows(ranked[0]) == MARKED | {7}  # the next search sees the commit
    finally:
        searcher.close()


def serve_args(settings: PgSettings, lexical: str) -> list[str]:
    return [
        "serve",
        "--backend",
        "pgvector",
        "--pg-dsn",
        settings.dsn,
        "--pg-table",
        settings.table,
        "--pg-lexical",
        lexical,
    ]


def served(settings: PgSettings, lexical: str) -> PgServing:
    """``serve``'s settings of the table with ``--pg-lexical lexical``."""
    return serve_settings(build_parser().parse_args(serve_args(settings, lexical)))


def test_the_hybrid_index_fuses_the_full_text_ranking(table: PgSettings, vectors: np.ndarray) -> None:
    index, _ = table_index(served(table, "fts"), TableEmbedder(vectors))
    try:
        assert index.hybrid and index.lexical is None
        query = vectors[3]
        _, found = index.search(query, 10, query_text=WORD)
        assert set(index.passage_ids_of(found)) & {f"p{row:05d}" for row in MARKED}
        staged = list(index.search_staged(query, 10, query_text=WORD))
        np.testing.assert_array_equal(staged[-1].ids, found)
    finally:
        index.searcher.close()  # type: ignore[attr-defined]


def test_a_bad_channel_is_refused(table: PgSettings, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(serve_args(table, "grep"))
    assert exited.value.code == 2
    assert "--pg-lexical: invalid choice: 'grep'" in capsys.readouterr().err


def test_a_table_without_the_tsvector_is_refused_saying_how_to_add_it(
    table: PgSettings, vectors: np.ndarray
) -> None:
    with psycopg.connect(table.dsn, autocommit=True) as connection:
        connection.execute(f"ALTER TABLE {table.table} DROP COLUMN specrag_fts")
    with pytest.raises(InvalidInputError, match=r"specrag_fts.*ALTER TABLE.*--pg-lexical bm25"):
        table_index(served(table, "fts"), TableEmbedder(vectors))
    index, _ = table_index(served(table, "bm25"), TableEmbedder(vectors))
    index.searcher.close()  # type: ignore[attr-defined]
