"""The documents API written through to a pgvector table, on a real server: each write is in the
table (read on a connection of its own) when it is answered, searches that start afterwards find
the new version only, and one that started before keeps the version its snapshot holds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psycopg
import pytest

from specrag.cli import build_parser
from specrag.errors import NotFoundError
from specrag.paths import DataLayout
from specrag.pipeline.store.table_corpus import TableCorpus
from specrag.retrieval.corpus import Passage, write_passages
from specrag.retrieval.pgvector.config import StageMode
from specrag.retrieval.pgvector.local_server import LocalPostgres
from specrag.retrieval.pgvector.writes import VERSION_COLUMN
from specrag.service.cli.commands import external_index
from specrag.service.run.assets import Assets, ensure_assets

NEW_TEXT = "The quokka plays a xylophone of driftwood on Rottnest Island every solstice."
REPLACED_TEXT = "A narwhal tunes its harpsichord beneath the Greenland ice in midwinter."


def served(postgres: LocalPostgres, tmp_path: Path, model_dir: Path, passages: list[Passage]) -> Assets:
    """``index build`` then ``serve``'s assets, on a table of this test's own."""
    corpus = tmp_path / "passages.jsonl"
    write_passages(corpus, passages)
    table = f"writes_{tmp_path.name.replace('-', '_')}"[:60]
    pg = ["--backend", "pgvector", "--pg-dsn", postgres.dsn, "--pg-table", table, "--pg-replace"]
    build = build_parser().parse_args(
        ["--data-dir", str(tmp_path), "index", "build", "--corpus", str(corpus), *pg]
    )
    assert build.handler(build) == 0
    args = build_parser().parse_args(["--data-dir", str(tmp_path), "serve", *pg[:-1]])
    return ensure_assets(DataLayout(tmp_path), model_dir, external=external_index(args))


def table_row(postgres: LocalPostgres, table: str, passage_id: str) -> tuple[str, int] | None:
    """(text, version) of a row as another client reads it: committed or nothing."""
    with psycopg.connect(postgres.dsn) as connection:
        found = connection.execute(
            f"SELECT text, {VERSION_COLUMN} FROM {table} WHERE id = %s", (passage_id,)
        ).fetchone()
    return None if found is None else (found[0], int(found[1]))


def found_texts(assets: Assets, text: str, k: int = 5) -> list[str]:
    """The texts a search that starts now returns for ``text`` (hybrid, as a query runs)."""
    index = assets.index
    _, rows = index.search(index.embed_query(text), k, query_text=text)
    return [assets.store.passage(int(row)).text for row in rows if row >= 0]


@pytest.fixture
def assets(
    postgres: LocalPostgres, tmp_path: Path, tiny_model_dir: Path, default_corpus: list[Passage]
) -> Iterator[Assets]:
    served_assets = served(postgres, tmp_path, tiny_model_dir, default_corpus[:300])
    yield served_assets
    served_assets.close()


def test_put_replace_delete_go_through_the_table(assets: Assets, postgres: LocalPostgres) -> None:
    corpus = assets.corpus
    assert isinstance(corpus, TableCorpus) and assets.documents_off is None
    table = assets.index.searcher.database.settings.table  # type: ignore[attr-defined]

    (written,) = corpus.put([Passage("quokka", "Quokka", NEW_TEXT)])
    assert (written.version, written.created, written.visible) == (1, True, True)
    assert table_row(postgres, table, "quokka") == (NEW_TEXT, 1)
    assert NEW_TEXT in found_texts(assets, NEW_TEXT)
    assert corpus.get("quokka").text == NEW_TEXT

    (replaced,) = corpus.put([Passage("quokka", "Quokka", REPLACED_TEXT)])
    assert (replaced.version, replaced.created) == (2, False)
    assert table_row(postgres, table, "quokka") == (REPLACED_TEXT, 2)
    assert REPLACED_TEXT in found_texts(assets, REPLACED_TEXT)
    assert NEW_TEXT not in found_texts(assets, NEW_TEXT, k=20)
    # The new version is a new row: its segment's label differs, so no cached form is shared.
    rows = [assets.store.row_of("quokka")]
    assert rows[0] >= len(assets.passages)

    base = assets.passages[3]
    (rewritten,) = corpus.put([Passage(base.id, base.title, REPLACED_TEXT + " Again.")])
    assert rewritten.version == 2 and table_row(postgres, table, base.id) == (REPLACED_TEXT + " Again.", 2)
    assert base.text not in found_texts(assets, base.text, k=20)

    assert corpus.delete(["quokka"])
    assert table_row(postgres, table, "quokka") is None
    assert REPLACED_TEXT not in found_texts(assets, REPLACED_TEXT, k=20)
    with pytest.raises(NotFoundError):
        corpus.get("quokka")
    (again,) = corpus.put([Passage("quokka", "Quokka", NEW_TEXT)])
    assert again.version == 4 and again.created  # a version is never given twice


def test_a_search_begun_before_a_replacement_keeps_its_version(assets: Assets) -> None:
    corpus = assets.corpus
    assert isinstance(corpus, TableCorpus)
    corpus.searcher.mode = StageMode.SEQUENTIAL  # one snapshot, taken at the first stage
    target = assets.passages[10]
    index = assets.index
    vector = index.embed_query(target.text)
    stages = iter(index.search_staged(vector, 5))
    next(stages)  # the snapshot is taken; the replacement commits after it
    corpus.put([Passage(target.id, target.title, REPLACED_TEXT)])
    *_, last = stages
    texts = [assets.store.passage(int(row)).text for row in np.atleast_1d(last.ids) if row >= 0]
    assert target.text in texts and REPLACED_TEXT not in texts
    assert REPLACED_TEXT in found_texts(assets, REPLACED_TEXT)
