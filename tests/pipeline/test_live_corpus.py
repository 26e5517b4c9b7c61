"""The live corpus: documents added, replaced and deleted on a served store and index, durably."""

from __future__ import annotations

import math
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from specrag.errors import ArtifactError, ConflictError, InvalidInputError, NotFoundError, TooLargeError
from specrag.pipeline.document_kv.store import segment_key
from specrag.pipeline.store.document_store import build_store
from specrag.pipeline.store.document_writes import MAX_BATCH_DOCUMENTS
from specrag.pipeline.store.live_corpus import RETRAIN_DRIFT, LiveCorpus
from specrag.pipeline.store.live_store import LiveStore
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.backends.local.staged_hnsw import StagedHNSW
from specrag.retrieval.backends.local.staged_ivf import StagedIVF
from specrag.retrieval.corpus import Passage
from specrag.retrieval.index_store import load_index
from specrag.retrieval.search.stages import StagedSearcher
from specrag.retrieval.synthetic import GaussianMixture
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assets import Assets
from tests.helpers.live_corpus import TableEmbedder, one_token_each

NEW_FACT = Passage("fact-1", "Quokka module", "The quokka module counts marsupials on Rottnest island.")


def open_live(assets: Assets, log: Path) -> LiveCorpus[LiveStore]:
    """A live corpus over the tiny assets' store and a fresh copy of their index, logging to ``log``."""
    index = load_index(assets.store.path.parent.parent / "index")
    return LiveCorpus.replayed(LiveStore(assets.store.path, log), index, assets.tokenizer.encode_batch)


def found(corpus: LiveCorpus, question: str, k: int = 5) -> list[int]:
    index = corpus.index
    _, ids = index.search(index.embed_query(question), k, query_text=question)
    return list(index.ranked_rows(ids))


@pytest.fixture
def corpus(tiny_assets: Assets, tmp_path: Path) -> LiveCorpus[LiveStore]:
    return open_live(tiny_assets, tmp_path / "log.sqlite")


def test_a_new_document_is_stored_tokenized_with_its_own_row_and_found(corpus: LiveCorpus) -> None:
    (written,) = corpus.put([NEW_FACT])
    assert (written.id, written.version, written.created) == ("fact-1", 1, True)
    row = corpus.store.row_of("fact-1")
    assert row == len(corpus.index.passage_ids) - 1 == len(corpus.store) - 1
    assert corpus.store.passage(row) == NEW_FACT
    segment = corpus.store.tokens(row)
    assert segment == tuple(corpus._tokenize_batch([f"[Doc {row}] {NEW_FACT.title}\n{NEW_FACT.text}\n\n"])[0])
    assert found(corpus, "How does the quokka module count marsupials?")[0] == row
    assert corpus.get("fact-1").version == 1


def test_a_replaced_document_is_a_new_row_and_the_old_one_is_never_found(corpus: LiveCorpus) -> None:
    old_row = corpus.store.row_of(corpus.index.passage_ids[0])
    old = corpus.store.passage(old_row)
    question = f"{old.title} {old.text[:200]}"
    assert old_row in found(corpus, question)
    (written,) = corpus.put([Passage(old.id, old.title, "Replaced: the quokka module now counts wombats.")])
    assert (written.version, written.created) == (2, False)
    new_row = corpus.store.row_of(old.id)
    assert new_row != old_row and corpus.store.passage(old_row) == old  # a query in flight still reads it
    # The document-KV store keys a segment by its tokens: the new version never reuses the old KV.
    assert segment_key(corpus.store.tokens(new_row)) != segment_key(corpus.store.tokens(old_row))
    assert old_row not in found(corpus, question, k=10)
    assert found(corpus, "what does the quokka module count now? wombats")[0] == new_row


def test_a_deleted_document_is_gone_and_an_unknown_one_is_404(corpus: LiveCorpus) -> None:
    corpus.put([NEW_FACT])
    row = corpus.store.row_of("fact-1")
    corpus.delete(["fact-1"])
    with pytest.raises(NotFoundError):
        corpus.get("fact-1")
    assert row not in found(corpus, "How does the quokka module count marsupials?", k=10)
    with pytest.raises(NotFoundError, match="no-such-id"):
        corpus.delete(["no-such-id"])
    (again,) = corpus.put([NEW_FACT])
    assert (again.version, again.created) == (3, True)


def test_every_change_is_replayed_at_start(tiny_assets: Assets, tmp_path: Path) -> None:
    log = tmp_path / "log.sqlite"
    first = open_live(tiny_assets, log)
    replaced = first.index.passage_ids[1]
    first.put([NEW_FACT, Passage(replaced, "t", "a second version")])
    first.put([Passage(replaced, "t", "a third version")])
    first.delete([first.index.passage_ids[2]])
    rows = (first.store.row_of("fact-1"), first.store.row_of(replaced))
    deleted = first.index.passage_ids[2]
    first.store.close()

    again = open_live(tiny_assets, log)
    # The start's checkpoint replays current versions only, on rows numbered anew after the base's.
    assert (again.store.row_of("fact-1"), again.store.row_of(replaced)) == (rows[0], rows[0] + 1) != rows
    assert again.store.tokens(rows[0] + 1) == tuple(
        again._tokenize_batch([f"[Doc {rows[0] + 1}] t\na third version\n\n"])[0]
    )
    assert again.get(replaced).text == "a third version" and again.get(replaced).version == 3
    with pytest.raises(NotFoundError):
        again.get(deleted)
    assert first.index.hidden_rows == 3  # row 1, its 2nd version, row 2
    assert again.index.hidden_rows == 2  # rows 1 and 2: the 2nd version is not replayed
    assert found(again, "How does the quokka module count marsupials?")[0] == rows[0]


def test_bad_writes_are_refused_with_what_is_wrong(corpus: LiveCorpus) -> None:
    with pytest.raises(InvalidInputError, match="once"):
        corpus.put([NEW_FACT, NEW_FACT])
    with pytest.raises(TooLargeError):
        corpus.put([Passage(f"d{i}", "", "x") for i in range(MAX_BATCH_DOCUMENTS + 1)])
    with pytest.raises(InvalidInputError, match="no documents"):
        corpus.put([])


def test_a_second_writer_on_the_same_log_is_refused(tiny_assets: Assets, tmp_path: Path) -> None:
    log = tmp_path / "log.sqlite"
    one, other = open_live(tiny_assets, log), open_live(tiny_assets, log)
    one.put([NEW_FACT])
    with pytest.raises(ConflictError, match="another process"):
        other.put([Passage("fact-2", "", "text")])


def test_a_log_of_changes_over_another_base_is_refused(tiny_assets: Assets, tmp_path: Path) -> None:
    log = tmp_path / "log.sqlite"
    written = open_live(tiny_assets, log)
    written.put([NEW_FACT])
    written.store.close()
    with sqlite3.connect(log) as connection:
        connection.execute("UPDATE meta SET value = 'other' WHERE key = 'corpus_checksum'")
    with pytest.raises(ArtifactError, match="holds 1 changes written over another base store"):
        LiveStore(tiny_assets.store.path, log)


def test_an_empty_log_follows_a_rebuilt_base(tiny_assets: Assets, tmp_path: Path) -> None:
    """A corpus rebuilt on purpose with no document changed live: nothing to lose, nothing refused."""
    log = tmp_path / "log.sqlite"
    LiveStore(tiny_assets.store.path, log).close()
    with sqlite3.connect(log) as connection:
        connection.execute("UPDATE meta SET value = 'other' WHERE key = 'corpus_checksum'")
    LiveStore(tiny_assets.store.path, log).close()
    with sqlite3.connect(log) as connection:
        (checksum,) = connection.execute("SELECT value FROM meta WHERE key = 'corpus_checksum'").fetchone()
    assert checksum == tiny_assets.store.info.corpus_checksum


def test_a_kill_9_right_after_an_acknowledged_write_loses_nothing(
    tiny_assets: Assets, tmp_path: Path
) -> None:
    """The writer is killed (SIGKILL: no clean-up of any kind) as soon as it acknowledged a write."""
    log = tmp_path / "log.sqlite"
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from specrag.pipeline.store.live_corpus import LiveCorpus
        from specrag.pipeline.store.live_store import LiveStore
        from specrag.pipeline.models.tokenizer import Tokenizer
        from specrag.retrieval.corpus import Passage
        from specrag.retrieval.index_store import TFIDF_SVD, IndexConfig, build_index, load_index

        store = Path({str(tiny_assets.store.path)!r})
        index = load_index(store.parent.parent / "index")
        tokenizer = Tokenizer(Path({str(tiny_assets.model_dir)!r}))
        corpus = LiveCorpus.replayed(LiveStore(store, Path({str(log)!r})), index, tokenizer.encode_batch)
        corpus.put([Passage("fact-1", "Quokka module", "The quokka module counts marsupials.")])
        print("acknowledged", flush=True)
        time.sleep(600)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "acknowledged"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    again = open_live(tiny_assets, log)
    assert again.get("fact-1").text == "The quokka module counts marsupials."
    assert found(again, "How does the quokka module count marsupials?")[0] == again.store.row_of("fact-1")


def test_a_compaction_starts_in_the_background_once_hidden_rows_pass_the_share(
    tiny_assets: Assets, tmp_path: Path
) -> None:
    index = load_index(tiny_assets.store.path.parent.parent / "index")
    store = LiveStore(tiny_assets.store.path, tmp_path / "log.sqlite")
    corpus = LiveCorpus.replayed(store, index, tiny_assets.tokenizer.encode_batch, compact_share=0.01)
    doomed = index.passage_ids[: math.ceil(len(index.passage_ids) / 100)]  # the least that reaches 1 %
    corpus.delete(doomed[:-1])
    corpus.wait_for_compaction()
    assert corpus.compactions == 0 and index.removable_rows == len(doomed) - 1  # below the share
    corpus.delete(doomed[-1:])
    corpus.wait_for_compaction()
    assert corpus.compactions == 1 and index.removable_rows == 0
    assert index.searcher.ntotal == len(index.passage_ids) - len(doomed)
    (written,) = corpus.put([NEW_FACT])  # the compacted index takes documents as before
    assert found(corpus, "How does the quokka module count marsupials?")[0] == store.row_of(written.id)


def table_corpus(tmp_path: Path, build: Callable[[np.ndarray], StagedSearcher]) -> LiveCorpus[LiveStore]:
    """A live corpus of 4,000 documents (``d<i>``) of one mixture, indexed by ``build``; the
    documents ``vec:4000`` to ``vec:4999`` added later lie in another mixture (drift)."""
    base = GaussianMixture(32, num_clusters=40, seed=1).sample(4000)
    drifted = GaussianMixture(32, num_clusters=40, seed=9).sample(1000)
    table = np.concatenate([base, drifted])
    passages = [Passage(f"d{i}", "", f"vec:{i}") for i in range(4000)]
    build_store(tmp_path / "store.sqlite", passages, one_token_each, "stand-in")
    index = VectorIndex(build(base), [p.id for p in passages], embedder=TableEmbedder(table))
    return LiveCorpus.replayed(LiveStore(tmp_path / "store.sqlite"), index, one_token_each)


def test_documents_that_drift_from_the_centroids_retrain_them_in_the_background(tmp_path: Path) -> None:
    corpus = table_corpus(tmp_path, lambda base: StagedIVF.build(base, nlist=64))
    index = corpus.index
    corpus.put([Passage(f"n{i}", "", f"vec:{4000 + i}") for i in range(300)])
    corpus.wait_for_compaction()
    assert (
        corpus.retrainings == 0 and corpus.drift is not None and corpus.drift > RETRAIN_DRIFT
    )  # too few yet
    corpus.put([Passage(f"n{i}", "", f"vec:{4000 + i}") for i in range(300, 1000)])
    corpus.wait_for_compaction()
    assert corpus.retrainings == 1 and corpus.drift is None  # measured anew against the new centroids
    assert index.search(index.embed_query("vec:4400"), 1)[1][0] == corpus.store.row_of("n400")


def test_an_hnsw_index_takes_drifted_documents_is_compacted_and_never_retrained(tmp_path: Path) -> None:
    corpus = table_corpus(tmp_path, lambda base: StagedHNSW.build(base, m=16, ef_search=48))
    corpus.put([Passage(f"n{i}", "", f"vec:{4000 + i}") for i in range(1000)])
    corpus.wait_for_compaction()
    assert corpus.retrainings == 0 and corpus.drift is None  # no centroids: nothing drifts
    index = corpus.index
    assert index.search(index.embed_query("vec:4400"), 1)[1][0] == corpus.store.row_of("n400")
    corpus.delete([f"d{i}" for i in range(1000)])  # a fifth of the 5,000 rows: compacted
    corpus.wait_for_compaction()
    assert corpus.compactions == 1 and index.removable_rows == 0 and index.searcher.ntotal == 4000
    assert index.search(index.embed_query("vec:4400"), 1)[1][0] == corpus.store.row_of("n400")
    with pytest.raises(InvalidInputError, match="no centroids"):
        corpus.compact(retrain=True)


def test_get_racing_a_write_returns_one_version_whole(
    corpus: LiveCorpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replacement lands while GET reads: it answers the old version or the new, never the old
    text under the new version number."""
    corpus.put([NEW_FACT])
    store, read = corpus.store, corpus.store.passage
    replaced = Passage(NEW_FACT.id, NEW_FACT.title, "The quokka module now counts wombats.")

    def write_then_read(row: int) -> Passage:
        monkeypatch.setattr(store, "passage", read)
        corpus.put([replaced])  # the racing write, between GET's reads
        return read(row)

    monkeypatch.setattr(store, "passage", write_then_read)
    document = corpus.get(NEW_FACT.id)
    assert (document.text, document.version) == (NEW_FACT.text, 1)
    assert (corpus.get(NEW_FACT.id).text, corpus.get(NEW_FACT.id).version) == (replaced.text, 2)


def test_a_document_longer_than_the_segment_limit_is_refused_naming_the_limit(corpus: LiveCorpus) -> None:
    """A document that fits no prompt would make every query retrieving it fail: 413 before the log."""
    short = len(corpus._tokenize_batch([f"[Doc 9999] {NEW_FACT.title}\n{NEW_FACT.text}\n\n"])[0])
    corpus.segment_token_limit = limit = 2 * short
    logged = len(list(corpus.store.logged()))
    long = Passage("long-1", "Long", " ".join(["marsupial counting on Rottnest island"] * 20))
    with pytest.raises(TooLargeError, match=rf"'long-1' is \d+ tokens long; at most {limit} fit"):
        corpus.put([NEW_FACT, long])
    assert len(list(corpus.store.logged())) == logged  # nothing of the batch was written
    with pytest.raises(NotFoundError):
        corpus.get("fact-1")
    (written,) = corpus.put([NEW_FACT])  # a short one still fits
    assert written.version == 1


def test_what_the_store_caches_per_row_follows_a_document_s_new_version(
    corpus: LiveCorpus, tiny_assets: Assets
) -> None:
    """Passages and token segments are cached by row, and a version is a row of its own: once a
    document is replaced, its id reads the new version and prompts carry its new tokens, however
    often the old one was read (and cached) before."""
    builder = PromptBuilder(tiny_assets.tokenizer, corpus.store)
    old_row = corpus.store.row_of(corpus.index.passage_ids[3])
    old = corpus.store.passage(old_row)
    old_prompt = builder.build([old_row], "what is it?")
    assert corpus.store.passage(old_row) is old  # read once, then from the cache
    corpus.put([Passage(old.id, old.title, "Replaced: the quokka module now counts wombats.")])
    new_row = corpus.store.row_of(old.id)
    assert corpus.store.passage(new_row).text == "Replaced: the quokka module now counts wombats."
    new_prompt = builder.build([new_row], "what is it?")
    assert new_prompt.token_ids != old_prompt.token_ids
    assert "wombats" in tiny_assets.tokenizer.decode(list(new_prompt.token_ids))
    assert builder.build([old_row], "what is it?") == old_prompt  # a query in flight still reads it
