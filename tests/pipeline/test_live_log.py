"""The live document log: bounded history, one writer at a time, checked rows and embedder."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from specrag.errors import ArtifactError, ConflictError, InvalidInputError
from specrag.pipeline.store.document_store import DocumentStore, build_store
from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.pipeline.store.live_log import Change, live_log_path
from specrag.pipeline.store.live_store import LiveStore
from specrag.retrieval.backends.local.staged_hnsw import StagedHNSW
from specrag.retrieval.corpus import Passage
from specrag.retrieval.synthetic import GaussianMixture
from specrag.retrieval.vector_index import VectorIndex
from tests.helpers.document_kv import kv_entry
from tests.helpers.live_corpus import TableEmbedder, one_token_each

BASE = 200
ROOT = Path(__file__).resolve().parents[2]
TABLE = GaussianMixture(16, num_clusters=8, seed=3).sample(BASE + 1000)


def base_store(directory: Path, fingerprint: str = "stand-in") -> Path:
    """A built store of ``BASE`` documents ``d<i>`` whose text ``vec:<i>`` names their vector."""
    path = directory / f"passages-{fingerprint}.sqlite"
    if not path.exists():
        passages = [Passage(f"d{i}", "", f"vec:{i}") for i in range(BASE)]
        build_store(path, passages, one_token_each, fingerprint)
    return path


def open_corpus(
    directory: Path, table: np.ndarray = TABLE, kv_dir: Path | None = None, grace_s: float = 0.0
) -> LiveCorpus[LiveStore]:
    """A live corpus over the base store in ``directory`` and a fresh HNSW index of its vectors."""
    store = LiveStore(base_store(directory), document_kv_dir=kv_dir, retired_grace_s=grace_s)
    index = VectorIndex(
        StagedHNSW.build(TABLE[:BASE], m=8, ef_search=32),
        [f"d{i}" for i in range(BASE)],
        embedder=TableEmbedder(table),
    )
    return LiveCorpus.replayed(store, index, one_token_each, compact_share=None)


def log_bytes(store: LiveStore) -> bytes:
    """Everything the log holds on disk: its file and its WAL."""
    wal = store.log_path.with_name(store.log_path.name + "-wal")
    return store.log_path.read_bytes() + (wal.read_bytes() if wal.exists() else b"")


def test_a_replaced_version_leaves_the_log_memory_and_the_document_kv_store(tmp_path: Path) -> None:
    kv_dir = tmp_path / "document-kv"
    corpus = open_corpus(tmp_path, kv_dir=kv_dir)
    store = corpus.store
    old_row = store.row_of("d5")
    old_entry = kv_entry(kv_dir, store.tokens(old_row))
    rows = []
    for version in range(2, 12):
        corpus.put([Passage("d5", "", f"vec:{BASE + version}")])
        rows.append(store.row_of("d5"))
    entry = kv_entry(kv_dir, store.tokens(rows[-1]))
    assert not old_entry.exists() and entry.exists()  # the base version's KV went with it
    for retired in rows[:-1]:  # a grace of 0: gone from memory at the next commit
        with pytest.raises(InvalidInputError, match="retired"):
            store.tokens(retired)
    with sqlite3.connect(store.log_path) as log:
        assert log.execute("SELECT id, version, row FROM changes").fetchall() == [("d5", 11, rows[-1])]
    assert corpus.get("d5").version == 11


def test_a_deleted_text_is_gone_from_the_log_file_and_its_wal(tmp_path: Path) -> None:
    corpus = open_corpus(tmp_path)
    secret = b"the-secret-title-nobody-may-keep"
    corpus.put([Passage("secret", secret.decode(), "vec:1100")])
    assert secret in log_bytes(corpus.store)
    corpus.delete(["secret"])
    assert secret not in log_bytes(corpus.store)
    (again,) = corpus.put([Passage("secret", "", "vec:1101")])
    assert again.version == 3  # the tombstone keeps the versions counting


def test_a_start_replays_current_versions_only_on_rows_numbered_anew(tmp_path: Path) -> None:
    corpus = open_corpus(tmp_path, grace_s=3600.0)
    for round_ in range(20):
        corpus.put([Passage(f"new{i}", "", f"vec:{BASE + 100 + round_ * 5 + i}") for i in range(5)])
        corpus.put([Passage("d0", "", f"vec:{BASE + round_}")])
    corpus.delete(["d1", "new3"])
    assert len(corpus.store) == BASE + 20 * 6 and len(corpus.store._rows) == 20 * 6  # the grace
    expected = {f"new{i}": corpus.get(f"new{i}") for i in (0, 1, 2, 4)} | {"d0": corpus.get("d0")}
    corpus.store.close()

    again = open_corpus(tmp_path)
    assert len(again.store) == len(again.index.passage_ids) == BASE + 5
    assert sorted(again.store.row_of(name) for name in expected) == list(range(BASE, BASE + 5))
    for name, document in expected.items():
        assert again.get(name) == document
        row = again.store.row_of(name)
        assert again.store.tokens(row) == (len(f"[Doc {row}] \n{document.text}\n\n"),)
        vector = again.index.embed_query(document.text)
        assert again.index.search(vector, 1)[1][0] == row
    assert again.index.hidden_rows == 2  # the base rows of d0 and d1, nothing of the history
    with sqlite3.connect(again.store.log_path) as log:
        assert log.execute("SELECT count(*) FROM changes").fetchone() == (7,)  # 5 live, 2 tombstones
    assert again.put([Passage("d1", "", "vec:1000")])[0].version == 3


def test_a_second_process_meets_the_writer_lock_at_once(tmp_path: Path) -> None:
    corpus = open_corpus(tmp_path)
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from specrag.errors import ConflictError
        from specrag.pipeline.store.live_store import LiveStore
        try:
            LiveStore(Path({str(corpus.store.path)!r}), data_dir=Path("/the/data/dir"))
        except ConflictError as error:
            print(error)
        """
    )

    def open_in_another_process() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    child = open_in_another_process()
    assert child.returncode == 0, child.stderr
    assert f"another process (pid {os.getpid()})" in child.stdout
    assert "/the/data/dir" in child.stdout and "specrag documents --url" in child.stdout
    corpus.store.close()  # the lock goes with the writer
    child = open_in_another_process()
    assert child.returncode == 0 and child.stdout == "", child.stderr


def test_an_offline_delete_beside_a_writer_is_a_conflict_never_a_repeated_version(tmp_path: Path) -> None:
    """Two writers the lock cannot tell apart (in one process): the second one's next write is refused."""
    serving = open_corpus(tmp_path)
    offline = open_corpus(tmp_path)
    offline.delete(["d3"])
    with pytest.raises(ConflictError, match="another process wrote"):
        serving.put([Passage("d3", "", "vec:1000")])
    with sqlite3.connect(serving.store.log_path) as log:
        assert log.execute("SELECT version FROM changes WHERE id = 'd3'").fetchall() == [(2,)]


def test_a_version_changed_under_the_writer_is_a_conflict(tmp_path: Path) -> None:
    corpus = open_corpus(tmp_path)
    corpus.put([Passage("d3", "", "vec:1000")])
    with sqlite3.connect(corpus.store.log_path) as log:  # the last sequence number stays as it was
        log.execute("UPDATE changes SET version = 7 WHERE id = 'd3'")
    with pytest.raises(ConflictError, match="another process wrote"):
        corpus.put([Passage("d3", "", "vec:1001")])


def test_a_damaged_log_row_is_named_at_start(tmp_path: Path) -> None:
    corpus = open_corpus(tmp_path)
    corpus.put([Passage("n1", "", "vec:1000"), Passage("n2", "title", "vec:1001")])
    corpus.store.close()
    with sqlite3.connect(corpus.store.log_path) as log:
        log.execute("UPDATE changes SET title = 'tit1e' WHERE id = 'n2'")
    with pytest.raises(ArtifactError, match=r"live\.sqlite: change 2 \(document 'n2', version 1\)"):
        open_corpus(tmp_path)


def test_vectors_of_another_embedder_are_refused_at_start(tmp_path: Path) -> None:
    corpus = open_corpus(tmp_path)
    corpus.put([Passage("n1", "", "vec:1000")])
    corpus.store.close()
    other = GaussianMixture(16, num_clusters=8, seed=4).sample(BASE + 1000)  # same kind and dimension
    with pytest.raises(ArtifactError, match=r"cosine of .* rebuilt with another embedder"):
        open_corpus(tmp_path, table=other)
    open_corpus(tmp_path).store.close()  # the right embedder replays it


def test_another_models_log_with_changes_is_not_hidden(tmp_path: Path) -> None:
    corpus = open_corpus(tmp_path)
    corpus.put([Passage("n1", "", "vec:1000")])
    corpus.store.close()
    with pytest.raises(
        ArtifactError, match=r"passages-stand-in\.live\.sqlite \(1 changes\), the log of another"
    ):
        LiveStore(base_store(tmp_path, "other-tokenizer"))


def test_a_failure_after_the_commit_reads_the_store_again_from_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = open_corpus(tmp_path)
    store = corpus.store
    corpus.put([Passage("d2", "", "vec:1000")])
    row = store.next_row

    def failing(*_: object) -> None:
        store._current["d2"] = None  # type: ignore[assignment]  # half done, then failed
        raise MemoryError("injected")

    monkeypatch.setattr(store, "_install", failing)
    change = Change("d2", 3, row, Passage("d2", "", "vec:1001"), (1,), TABLE[1001])
    store.commit([change])
    monkeypatch.undo()
    assert store.version_of("d2") is not None and store.version_of("d2") == store._current["d2"]
    assert (store.row_of("d2"), store.version_of("d2").version, store.next_row) == (row, 3, row + 1)  # type: ignore[union-attr]
    assert store.passage(row) == Passage("d2", "", "vec:1001")
    corpus.index.apply_changes(["d2"], TABLE[[1001]], ["vec:1001"], [row - 1])  # what the corpus does
    (written,) = corpus.put([Passage("d4", "", "vec:1002")])
    assert store.row_of("d4") == row + 1 == len(corpus.index.passage_ids) - 1 and written.version == 2


def test_a_replaced_versions_kv_goes_at_once_while_its_row_stays_for_the_grace(tmp_path: Path) -> None:
    kv_dir = tmp_path / "document-kv"
    corpus = open_corpus(tmp_path, kv_dir=kv_dir, grace_s=3600.0)
    corpus.put([Passage("n1", "", "vec:1000")])
    row = corpus.store.row_of("n1")
    entry = kv_entry(kv_dir, corpus.store.tokens(row))
    corpus.put([Passage("n1", "", "vec:1001")])
    assert not entry.exists()
    assert corpus.store.passage(row) == Passage("n1", "", "vec:1000")  # a query in flight reads it
    assert corpus.store.drop_retired(now=float("inf")) == 1
    with pytest.raises(InvalidInputError, match="retired"):
        corpus.store.passage(row)


def test_a_log_of_the_first_schema_is_given_checksums_and_replayed(tmp_path: Path) -> None:
    store = base_store(tmp_path)
    info, log = DocumentStore(store).info, live_log_path(store)

    def version(row: int, number: int, text: str) -> tuple[object, ...]:
        tokens = np.asarray([len(f"[Doc {row}] \n{text}\n\n")], dtype="<u4").tobytes()
        vector = np.asarray(TABLE[int(text[4:])], dtype="<f4").tobytes()
        return ("n1", number, row, "", text, tokens, vector)

    with sqlite3.connect(log) as connection:
        connection.executescript(
            """
            CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            CREATE TABLE changes (seq INTEGER PRIMARY KEY, id TEXT NOT NULL, version INTEGER NOT NULL,
                row INTEGER, title TEXT, text TEXT, tokens BLOB, vector BLOB);
            """
        )
        meta = {
            "schema_version": "1",
            "corpus_checksum": info.corpus_checksum,
            "tokenizer_fingerprint": info.tokenizer_fingerprint,
            "segment_template": info.segment_template,
        }
        connection.executemany("INSERT INTO meta VALUES (?, ?)", meta.items())
        rows = [
            version(BASE, 1, "vec:1000"),
            version(BASE + 1, 2, "vec:1001"),
            ("d0", 2, None, None, None, None, None),
        ]
        connection.executemany("INSERT INTO changes VALUES (NULL, ?, ?, ?, ?, ?, ?, ?)", rows)
    corpus = open_corpus(tmp_path)
    assert corpus.get("n1").version == 2 and corpus.store.row_of("n1") == BASE
    assert corpus.index.search(corpus.index.embed_query("vec:1001"), 1)[1][0] == BASE
    assert corpus.store.version_of("d0") is not None and corpus.store.version_of("d0").row is None  # type: ignore[union-attr]
    with sqlite3.connect(log) as connection:
        assert connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("2",)
        assert connection.execute("SELECT count(*) FROM changes WHERE checksum IS NOT NULL").fetchone() == (
            2,
        )
