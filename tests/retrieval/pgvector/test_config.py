"""Column mapping, bad configurations and a database killed and restarted, on a real server."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest

from specrag.cli import build_parser, main
from specrag.errors import InvalidInputError
from specrag.retrieval.backends.pgvector.backend import serve_settings
from specrag.retrieval.backends.pgvector.config import Columns, PgServing, PgSettings, describe_dsn
from specrag.retrieval.backends.pgvector.database import Database, DatabaseUnavailableError
from specrag.retrieval.backends.pgvector.local_server import LocalPostgres
from specrag.retrieval.backends.pgvector.searcher import PgVectorSearcher
from specrag.retrieval.backends.pgvector.table import inspect_table, load_table, read_passages
from tests.helpers.tables import table_index
from tests.helpers.vectors import DIM, passages_for

SECRET = "hunter2-not-a-real-password"


class FixedEmbedder:
    """The user's own model, as far as the table's vectors go: it embeds nothing here."""

    kind = "fixed"

    def __init__(self, dim: int) -> None:
        self._dim = dim

    @property
    def dim(self) -> int:
        return self._dim

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return np.zeros((len(texts), self._dim), dtype=np.float32)

    def save(self, directory: Path) -> dict[str, Any]:
        return {}


def serve_args(dsn: str, table: str, **flags: Any) -> PgServing:
    """``serve --backend pgvector``'s settings of the table, with ``flags`` (``pg_index="hnsw"``:
    ``--pg-index hnsw``; None: not given)."""
    line = ["serve", "--backend", "pgvector", "--pg-dsn", dsn, "--pg-table", table, "--pg-pool-size", "4"]
    for name, value in flags.items():
        if value is not None:
            line += [f"--{name.replace('_', '-')}", str(value)]
    return serve_settings(build_parser().parse_args(line))


@pytest.fixture(scope="module")
def users_table(postgres: LocalPostgres, vectors: np.ndarray) -> str:
    """A table another application made: its own names, integer ids, a cosine index."""
    with psycopg.connect(postgres.dsn, autocommit=True) as connection:
        connection.execute("CREATE EXTENSION IF NOT EXISTS vector")
        connection.execute("DROP TABLE IF EXISTS docs")
        connection.execute(
            f"CREATE TABLE docs (doc_id bigint PRIMARY KEY, heading text, body text, vec vector({DIM}))"
        )
        with connection.cursor() as cursor, cursor.copy("COPY docs FROM STDIN") as copy:
            for row, vector in enumerate(vectors[:2000]):
                copy.write_row((row, f"heading {row}", f"body {row}", "[" + ",".join(map(str, vector)) + "]"))
        connection.execute("CREATE INDEX ON docs USING ivfflat (vec vector_cosine_ops) WITH (lists = 20)")
        connection.execute("CREATE TABLE docs_hnsw (id text, title text, text text, embedding vector(32))")
        connection.execute("CREATE INDEX ON docs_hnsw USING hnsw (embedding vector_ip_ops)")
    return "docs"


def test_a_users_table_is_searched_through_the_column_mapping(
    postgres: LocalPostgres, users_table: str, vectors: np.ndarray
) -> None:
    args = serve_args(postgres.dsn, users_table, pg_columns="id=doc_id,title=heading,text=body,embedding=vec")
    index, passages = table_index(args, embedder=FixedEmbedder(DIM), lexical=False)
    try:
        assert passages[0].title.startswith("heading") and len(passages) == 2000
        query = vectors[7]
        _, rows = index.search(query, 5)
        found = index.passage_ids_of(rows)
        assert found[0] == "7"  # the row itself, under the table's own id
        assert index.searcher.settings["metric"] == "cosine"
        assert "dsn" not in str(index.searcher.settings).lower() and postgres.dsn not in str(
            index.searcher.settings
        )
    finally:
        index.searcher.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"pg_columns": "id=doc_id,title=heading,text=body"}, "'embedding'"),  # no such column
        ({"pg_columns": "id=doc_id,title=nope,text=body,embedding=vec"}, "'nope'"),
        ({"pg_columns": "id=doc_id,title=heading,text=body,embedding=vec", "pg_metric": "ip"}, "'vec'"),
        ({"pg_table": "docs_hnsw", "pg_index": "ivfflat"}, "'embedding'"),  # HNSW only, IVFFlat asked
        ({"pg_table": "no_such_table"}, "no_such_table"),
    ],
)
def test_a_bad_configuration_is_refused_naming_the_column(
    postgres: LocalPostgres, users_table: str, extra: dict[str, Any], named: str
) -> None:
    args = serve_args(postgres.dsn, extra.pop("pg_table", users_table), **extra)
    with pytest.raises(InvalidInputError, match=named):
        table_index(args, embedder=FixedEmbedder(DIM), lexical=False)


def test_a_dimension_mismatch_names_the_column(postgres: LocalPostgres, users_table: str) -> None:
    args = serve_args(postgres.dsn, users_table, pg_columns="id=doc_id,title=heading,text=body,embedding=vec")
    with pytest.raises(InvalidInputError, match=r"'vec'.*vector\(32\).*16"):
        table_index(args, embedder=FixedEmbedder(16), lexical=False)


def test_column_specs_are_checked() -> None:
    assert Columns.parse("embedding=vec").embedding == "vec"
    for bad in ("vector=vec", "id", "id=a b", "id="):
        with pytest.raises(InvalidInputError, match="--pg-columns"):
            Columns.parse(bad)


def test_an_unreachable_server_names_the_host_never_the_password(tmp_path: Path) -> None:
    dsn = f"host={tmp_path} port=5999 user=someone dbname=things password={SECRET}"
    settings = PgSettings(dsn, table="t")
    assert SECRET not in repr(settings) and SECRET not in describe_dsn(dsn)
    with pytest.raises(DatabaseUnavailableError) as caught:
        Database(settings, open_timeout_s=1.0)
    assert str(tmp_path) in str(caught.value) and SECRET not in str(caught.value)


def test_the_cli_exits_2_without_echoing_the_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "some words here"}\n')
    assert main(["index", "build", "--backend", "pgvector", "--corpus", str(corpus)]) == 2
    assert "SPECRAG_PG_DSN" in capsys.readouterr().err
    monkeypatch.setenv("SPECRAG_PG_DSN", f"host={tmp_path} port=5999 password={SECRET}")
    code = main(
        [
            "index",
            "build",
            "--backend",
            "pgvector",
            "--corpus",
            str(corpus),
            "--embedder",
            "tfidf-svd",
            "--dim",
            "4",
        ]
    )
    error = capsys.readouterr().err
    assert code == 2 and str(tmp_path) in error and SECRET not in error


def test_a_killed_database_fails_queries_clearly_and_recovers(vectors: np.ndarray) -> None:
    with LocalPostgres() as server:
        dsn = f"{server.dsn} password={SECRET}"  # trust auth ignores it; it must still never show
        settings = PgSettings(dsn, table="t", statement_timeout_s=2.0, pool_size=2)
        load_table(settings, passages_for(vectors[:1000]), vectors[:1000], nlist=16)
        database = Database(settings)
        layout = inspect_table(database, DIM)
        searcher = PgVectorSearcher(database, layout, [p.id for p in read_passages(database)])
        try:
            query = vectors[3][None, :]
            _, before = searcher.search(query, 5)
            server.kill()
            with pytest.raises(DatabaseUnavailableError) as caught:
                searcher.search(query, 5)
            assert str(server.root) in str(caught.value) and SECRET not in str(caught.value)
            server.start()
            _, after = searcher.search(query, 5)  # the pool replaced its dead connections
            np.testing.assert_array_equal(after, before)
        finally:
            searcher.close()


def test_index_build_makes_an_hnsw_table_that_serve_checks(postgres: LocalPostgres, tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        "".join(f'{{"id": "d{n}", "text": "passage {n} on topic {n % 5} with word{n}"}}\n' for n in range(40))
    )
    pg = ["--backend", "pgvector", "--pg-dsn", postgres.dsn, "--pg-table", "cli_hnsw"]
    build = ["--data-dir", str(tmp_path), "index", "build", "--corpus", str(corpus), *pg]
    assert main([*build, "--pg-index", "hnsw", "--embedder", "tfidf-svd", "--dim", "4"]) == 0
    index, passages = table_index(
        serve_args(postgres.dsn, "cli_hnsw"), embedder=FixedEmbedder(4), lexical=False
    )
    try:
        assert len(passages) == 40 and index.searcher.settings["index"] == "hnsw"
    finally:
        index.searcher.close()  # type: ignore[attr-defined]
    with pytest.raises(InvalidInputError, match=r"'embedding'.*no ivfflat index.*hnsw"):
        table_index(serve_args(postgres.dsn, "cli_hnsw", pg_index="ivfflat"), embedder=FixedEmbedder(4))


def test_the_search_deadline_is_below_the_first_token_timeout(postgres: LocalPostgres) -> None:
    def chosen(given: float | None, first_token: float | None = None) -> float:
        settings = serve_args(postgres.dsn, "docs", pg_search_timeout=given, first_token_timeout=first_token)
        return settings.table.search_timeout_s

    assert chosen(None, 6.0) == 3.0  # half the first-token timeout, shorter than the default
    assert chosen(None) == 10.0 and chosen(5.0, 60.0) == 5.0
    with pytest.raises(InvalidInputError, match="--pg-search-timeout 70 must be below --first-token-time"):
        chosen(70.0, 60.0)
