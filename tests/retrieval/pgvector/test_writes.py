"""The documents API written through to a pgvector table, on a real server: each write is in the
table (read on a connection of its own) when it is answered, searches that start afterwards find
the new version only, and one that started before keeps the version its snapshot holds; rows
another application changes are noticed (the change trigger and listener) and shown the same way;
the full-text channel (``--pg-lexical fts``) ranks a written version and not the one it replaced."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psycopg
import pytest

from specrag.cli import build_parser
from specrag.errors import NotFoundError
from specrag.paths import DataLayout
from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.pipeline.store.table_corpus import TableStore, follow_table
from specrag.retrieval.backends.pgvector.config import StageMode
from specrag.retrieval.backends.pgvector.local_server import LocalPostgres
from specrag.retrieval.backends.pgvector.searcher import PgVectorSearcher
from specrag.retrieval.backends.pgvector.writes import VERSION_COLUMN
from specrag.retrieval.backends.registry import chosen
from specrag.retrieval.corpus import Passage, write_passages
from specrag.retrieval.live_index import Visibility
from specrag.service.run.assets import Assets, ensure_assets
from tests.helpers.document_kv import kv_entry

NEW_TEXT = "The quokka plays a xylophone of driftwood on Rottnest Island every solstice."
REPLACED_TEXT = "A narwhal tunes its harpsichord beneath the Greenland ice in midwinter."


def served(
    postgres: LocalPostgres, tmp_path: Path, model_dir: Path, passages: list[Passage], lexical: str = "bm25"
) -> Assets:
    """``index build`` then ``serve``'s assets (``--pg-lexical lexical``), on a table of this test's own."""
    corpus = tmp_path / "passages.jsonl"
    write_passages(corpus, passages)
    table = f"writes_{tmp_path.name.replace('-', '_')}"[:60]
    pg = ["--backend", "pgvector", "--pg-dsn", postgres.dsn, "--pg-table", table, "--pg-replace"]
    build = build_parser().parse_args(
        ["--data-dir", str(tmp_path), "index", "build", "--corpus", str(corpus), *pg]
    )
    assert build.handler(build) == 0
    args = build_parser().parse_args(
        ["--data-dir", str(tmp_path), "serve", *pg[:-1], "--pg-lexical", lexical]
    )
    return ensure_assets(DataLayout(tmp_path), model_dir, backend=chosen(args))


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


def table_corpus(assets: Assets) -> LiveCorpus[TableStore]:
    """The corpus of served ``assets``: a pgvector table's, its documents API on."""
    corpus = assets.corpus
    assert isinstance(corpus, LiveCorpus) and isinstance(corpus.store, TableStore)
    return corpus


@pytest.fixture
def assets(
    postgres: LocalPostgres, tmp_path: Path, tiny_model_dir: Path, default_corpus: list[Passage]
) -> Iterator[Assets]:
    served_assets = served(postgres, tmp_path, tiny_model_dir, default_corpus[:300])
    yield served_assets
    served_assets.close()
    corpus = served_assets.corpus
    if isinstance(corpus, LiveCorpus) and isinstance(corpus.store, TableStore) and corpus.store.listener:
        assert not corpus.store.listener.thread.is_alive()  # stopped with the connections


def test_put_replace_delete_go_through_the_table(assets: Assets, postgres: LocalPostgres) -> None:
    corpus = table_corpus(assets)
    assert assets.documents_off is None
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


def test_a_replaced_versions_document_kv_is_removed(assets: Assets, tmp_path: Path) -> None:
    """As the live corpus does: a replaced or deleted version's KV is of no further use and holds
    what the document said, so it leaves the data directory's document-KV store."""
    corpus = table_corpus(assets)
    kv_dir = DataLayout(tmp_path).document_kv_dir
    base, other = assets.passages[20], assets.passages[21]
    replaced = kv_entry(kv_dir, assets.store.tokens(assets.store.row_of(base.id)))
    deleted = kv_entry(kv_dir, assets.store.tokens(assets.store.row_of(other.id)))
    kept = kv_entry(kv_dir, assets.store.tokens(assets.store.row_of(assets.passages[22].id)))
    corpus.put([Passage(base.id, base.title, REPLACED_TEXT)])
    assert corpus.delete([other.id])
    assert not replaced.exists() and not deleted.exists() and kept.exists()


def test_a_search_begun_before_a_replacement_keeps_its_version(assets: Assets) -> None:
    corpus = table_corpus(assets)
    corpus.store.searcher.mode = StageMode.SEQUENTIAL  # one snapshot, taken at the first stage
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


def test_a_search_between_a_commit_and_the_swap_finds_the_document_once(
    assets: Assets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search whose visibility predates a replacement's COMMIT but whose snapshot follows it
    meets the new version in the table: it shows the version its visibility holds, so the
    document is found in one version, not missed. The write is held between its COMMIT and the
    index's swap (the searcher naming the new row is the swap's first step)."""
    corpus = table_corpus(assets)
    target = assets.passages[30]
    searcher = corpus.store.searcher
    committed, release = threading.Event(), threading.Event()
    map_rows = searcher.map_rows

    def held_map_rows(keys: list[tuple[str, int]], first_row: int) -> None:
        committed.set()
        assert release.wait(WAIT_S)
        map_rows(keys, first_row)

    monkeypatch.setattr(searcher, "map_rows", held_map_rows)
    writer = threading.Thread(target=corpus.put, args=([Passage(target.id, target.title, REPLACED_TEXT)],))
    writer.start()
    try:
        assert committed.wait(WAIT_S)
        for mode in (StageMode.SEQUENTIAL, StageMode.PARALLEL):
            searcher.mode = mode
            vector = assets.index.embed_query(REPLACED_TEXT)  # the table's new vector ranks first
            *_, last = assets.index.search_staged(vector, 5)  # an early stage may not reach its list
            for rows in (assets.index.search(vector, 5)[1], last.ids):
                found = [assets.store.passage(int(row)) for row in np.atleast_1d(rows) if row >= 0]
                assert [p.text for p in found if p.id == target.id] == [target.text], mode
    finally:
        release.set()
        writer.join(WAIT_S)
    assert REPLACED_TEXT in found_texts(assets, REPLACED_TEXT)


def test_searches_beside_a_writer_find_the_document_once(assets: Assets) -> None:
    """A writer replaces one document over and over (two texts of nearly one meaning) while
    one-shot searches run beside it, for a bounded time: each finds the document once."""
    corpus = table_corpus(assets)
    target = assets.passages[50]
    texts = (NEW_TEXT, NEW_TEXT + " Again.")
    stop = threading.Event()
    writes = 0

    def write() -> None:
        nonlocal writes
        while not stop.is_set():
            corpus.put([Passage(target.id, target.title, texts[writes % 2])])
            writes += 1

    corpus.put([Passage(target.id, target.title, texts[1])])
    writer = threading.Thread(target=write)
    writer.start()
    searches = 0
    vector = assets.index.embed_query(NEW_TEXT)
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            rows = assets.index.search(vector, 5)[1]
            ids = [assets.store.passage(int(row)).id for row in rows if row >= 0]
            assert ids.count(target.id) == 1, (searches, writes)
            searches += 1
    finally:
        stop.set()
        writer.join(WAIT_S)
    assert writes > 5 and searches > 5


OTHER_TEXT = "A wombat paints cubes of ochre on the shore of Lake Eyre each spring."
INSERTED_TEXT = "The axolotl keeps a ledger of moonlit tides in a Mexican canal."
WAIT_S = 10.0


def eventually(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, "the change was not shown within the bound"
        time.sleep(0.1)


def other_writer(postgres: LocalPostgres, statement: str, params: tuple[object, ...]) -> None:
    """Another application's write: its own connection, committed."""
    with psycopg.connect(postgres.dsn, autocommit=True) as connection:
        connection.execute(statement, params)


def test_another_writers_update_insert_and_delete_are_shown(assets: Assets, postgres: LocalPostgres) -> None:
    """The change trigger numbers another application's version and notifies; the listener shows
    it, so searches that start afterwards find the new text and never the old one."""
    corpus = table_corpus(assets)
    assert corpus.store.listener is not None
    assert corpus.store.listener.connected.wait(WAIT_S)
    table = corpus.store.searcher.database.settings.table
    target = assets.passages[7]

    # With an embedding of its own (another row's): a text left with its former embedding is
    # embedded anew by the service, the test below.
    other_writer(
        postgres,
        f"UPDATE {table} SET text = %s, embedding = (SELECT embedding FROM {table} WHERE id = %s) "
        "WHERE id = %s",
        (OTHER_TEXT, assets.passages[9].id, target.id),
    )
    assert table_row(postgres, table, target.id) == (OTHER_TEXT, 2)  # the trigger numbered it
    eventually(lambda: OTHER_TEXT in found_texts(assets, OTHER_TEXT))
    assert target.text not in found_texts(assets, target.text, k=20)
    assert corpus.get(target.id).text == OTHER_TEXT and corpus.get(target.id).version == 2
    assert assets.store.row_of(target.id) >= len(assets.passages)  # a new row: no cache shared

    source = assets.passages[8]
    other_writer(
        postgres,
        f"INSERT INTO {table} (id, title, text, embedding) "
        f"SELECT %s, %s, %s, embedding FROM {table} WHERE id = %s",
        ("axolotl", "Axolotl", INSERTED_TEXT, source.id),
    )
    eventually(lambda: INSERTED_TEXT in found_texts(assets, INSERTED_TEXT))
    assert corpus.get("axolotl").version == 1

    other_writer(postgres, f"DELETE FROM {table} WHERE id = %s", ("axolotl",))
    eventually(lambda: INSERTED_TEXT not in found_texts(assets, INSERTED_TEXT, k=20))

    # The documents API's own write is not numbered twice nor shown twice.
    (written,) = corpus.put([Passage(target.id, target.title, target.text)])
    assert written.version == 3 and table_row(postgres, table, target.id) == (target.text, 3)
    time.sleep(1.0)
    assert corpus.get(target.id).version == 3 and target.text in found_texts(assets, target.text)


def test_another_writers_delete_then_insert_is_a_new_version(assets: Assets, postgres: LocalPostgres) -> None:
    """Another application replaces a row by DELETE then INSERT in one transaction (an upsert by
    hand): the row's version goes on from the deleted one's, never back to 1, so the service
    sees a new version and shows the new text."""
    corpus = table_corpus(assets)
    assert corpus.store.listener is not None
    assert corpus.store.listener.connected.wait(WAIT_S)
    table = corpus.store.searcher.database.settings.table
    target, source = assets.passages[20], assets.passages[21]
    with psycopg.connect(postgres.dsn) as connection:  # one transaction, committed at the end
        connection.execute(f"DELETE FROM {table} WHERE id = %s", (target.id,))
        connection.execute(
            f"INSERT INTO {table} (id, title, text, embedding) SELECT %s, %s, %s, embedding FROM {table} "
            "WHERE id = %s",
            (target.id, target.title, OTHER_TEXT, source.id),
        )
    assert table_row(postgres, table, target.id) == (OTHER_TEXT, 2)
    eventually(lambda: corpus.get(target.id).text == OTHER_TEXT)
    assert corpus.get(target.id).version == 2 and OTHER_TEXT in found_texts(assets, OTHER_TEXT)


def dense_texts(assets: Assets, text: str, k: int = 5) -> list[str]:
    """The texts a vector-only search finds for ``text``: what the table's embeddings rank."""
    index = assets.index
    _, rows = index.search(index.embed_query(text), k)
    return [assets.store.passage(int(row)).text for row in rows if row >= 0]


def test_a_new_text_left_with_its_former_embedding_is_embedded_anew(
    assets: Assets, postgres: LocalPostgres
) -> None:
    """Another application changes a row's text but not its embedding: the service's embedder
    made that embedding (it makes it again from the former text), so it embeds the new text and
    writes the vector back as the next version; vector search then finds the new text."""
    corpus = table_corpus(assets)
    assert corpus.store.listener is not None
    assert corpus.store.listener.connected.wait(WAIT_S)
    table = corpus.store.searcher.database.settings.table
    target = assets.passages[40]
    assert OTHER_TEXT not in dense_texts(assets, OTHER_TEXT)
    other_writer(postgres, f"UPDATE {table} SET text = %s WHERE id = %s", (OTHER_TEXT, target.id))
    eventually(lambda: corpus.get(target.id).version == 3)
    assert table_row(postgres, table, target.id) == (OTHER_TEXT, 3)  # 2: the writer's; 3: the vector
    assert OTHER_TEXT in dense_texts(assets, OTHER_TEXT)
    assert target.text not in found_texts(assets, target.text, k=20)
    time.sleep(1.0)  # the notification of its own write-back is not shown again
    assert corpus.get(target.id).version == 3


def test_changes_missed_while_not_listening_are_reconciled(assets: Assets, postgres: LocalPostgres) -> None:
    """A change nobody heard of (as while the listener was disconnected) is found by comparing
    the table's (id, version) set with what the service holds."""
    corpus = table_corpus(assets)
    assert corpus.store.listener is not None
    assert corpus.store.listener.connected.wait(WAIT_S)  # its own reconcile at connect is done
    table = corpus.store.searcher.database.settings.table
    target = assets.passages[12]
    with psycopg.connect(postgres.dsn, autocommit=True) as connection:
        # Without the trigger (as while the service was down), nothing is heard of the change.
        connection.execute(f"ALTER TABLE {table} DISABLE TRIGGER specrag_changes")
        connection.execute(
            f"UPDATE {table} SET text = %s, specrag_version = specrag_version + 1 WHERE id = %s",
            (OTHER_TEXT, target.id),
        )
        connection.execute(f"ALTER TABLE {table} ENABLE TRIGGER specrag_changes")
    assert follow_table(corpus) == 1
    assert OTHER_TEXT in found_texts(assets, OTHER_TEXT)
    assert target.text not in found_texts(assets, target.text, k=20)
    assert follow_table(corpus) == 0


def test_a_truncate_is_shown_at_once(assets: Assets, postgres: LocalPostgres) -> None:
    """A TRUNCATE fires no row trigger; its statement trigger's notification makes the listener
    reconcile, so the rows are gone from searches without waiting for a reconnect."""
    corpus = table_corpus(assets)
    assert corpus.store.listener is not None
    assert corpus.store.listener.connected.wait(WAIT_S)
    table = corpus.store.searcher.database.settings.table
    target = assets.passages[5]
    assert target.text in found_texts(assets, target.text)
    other_writer(postgres, f"TRUNCATE {table}", ())
    eventually(lambda: found_texts(assets, target.text) == [])
    with pytest.raises(NotFoundError):
        corpus.get(target.id)


def ranked_by_words(assets: Assets, text: str) -> list[str]:
    """The texts the table's full-text search alone ranks for ``text``, as a search starting now sees it."""
    index = assets.index
    visible = index.visible_rows
    shown = Visibility(np.concatenate([np.where(visible, 0, -1), [-1]]), int(np.count_nonzero(~visible)))
    searcher = index.searcher
    assert isinstance(searcher, PgVectorSearcher)
    _, _, ranked = searcher.search_text(index.embed_query(text)[None, :], 5, [text], 20, shown)
    return [
        assets.store.passage(int(passage)).text
        for passage in index.passage_index_of(ranked[0])
        if passage >= 0
    ]


def test_the_full_text_channel_finds_a_written_version_and_not_the_one_it_replaced(
    postgres: LocalPostgres, tmp_path: Path, tiny_model_dir: Path, default_corpus: list[Passage]
) -> None:
    assets = served(postgres, tmp_path, tiny_model_dir, default_corpus[:300], lexical="fts")
    try:
        corpus, index = table_corpus(assets), assets.index
        assert index.lexical is None and index.hybrid
        corpus.put([Passage("quokka", "Quokka", NEW_TEXT)])
        assert found_texts(assets, "quokka xylophone driftwood")[0] == NEW_TEXT
        assert ranked_by_words(assets, "quokka xylophone driftwood") == [NEW_TEXT]
        corpus.put([Passage("quokka", "Narwhal", REPLACED_TEXT)])
        assert found_texts(assets, "narwhal harpsichord")[0] == REPLACED_TEXT
        assert ranked_by_words(assets, "narwhal harpsichord") == [REPLACED_TEXT]
        assert ranked_by_words(assets, "quokka xylophone driftwood") == []  # the replaced version's words
    finally:
        assets.close()
