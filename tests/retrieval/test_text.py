"""Every spelling of a question retrieves what its plain spelling does: fullwidth
letters, a zero-width space inside a word, decomposed accents; and an index built by an earlier
version, from text not normalised, is rebuilt rather than searched with normalised questions."""

from __future__ import annotations

import json
import logging
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from specrag.paths import DataLayout
from specrag.retrieval.corpus import Passage
from specrag.retrieval.index_store import MANIFEST_FILE, VERSION, IndexConfig, build_index, save_index
from specrag.retrieval.text import normalize_text
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assets import ensure_index

ASSERT = "What does the assert statement do?"
SQLITE = "Who wrote the sqlite3 module, Gerhard Häring?"  # the corpus spells it in NFC


def fullwidth(text: str) -> str:
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else "\u3000" if c == " " else c for c in text)


@pytest.mark.parametrize(
    ("written", "plain"),
    [
        ("ｗｈａｔ ｄｏｅｓ", "what does"),
        ("as\u200bsert\u00ad \ufeffdo", "assert do"),
        ("Ha\u0308ring", "Häring"),
        (" two\t\n\u2003 spaces ", "two spaces"),
        ("plain ASCII", "plain ASCII"),
    ],
)
def test_every_spelling_normalises_to_the_plain_one(written: str, plain: str) -> None:
    assert normalize_text(written) == plain == normalize_text(plain)


@pytest.fixture(scope="module")
def index(default_corpus: list[Passage]) -> VectorIndex:
    """The default configuration (WordLlama + BM25, staged IVF) on the default corpus."""
    return build_index(default_corpus, IndexConfig())


def retrieved(index: VectorIndex, question: str, k: int = 10) -> list[str]:
    _, passages = index.search(index.embed_query(question), k, query_text=question)
    return [index.passage_ids[int(i)] for i in passages]


@pytest.mark.parametrize(
    ("plain", "spelling", "expected"),
    [
        (ASSERT, fullwidth(ASSERT), "topic/assert#0"),
        (ASSERT, ASSERT.replace("assert", "as\u200bsert"), "topic/assert#0"),
        (SQLITE, unicodedata.normalize("NFD", SQLITE), "doc/sqlite3#0"),
    ],
    ids=["fullwidth", "zero-width space inside a word", "NFD accents"],
)
def test_a_spelling_retrieves_what_the_plain_question_does(
    index: VectorIndex, plain: str, spelling: str, expected: str
) -> None:
    assert spelling != plain
    assert retrieved(index, plain)[0] == expected
    assert retrieved(index, spelling) == retrieved(index, plain)
    assert index.lexical is not None
    assert index.lexical.terms(spelling) == index.lexical.terms(plain)
    np.testing.assert_array_equal(index.embed_query(spelling), index.embed_query(plain))


def test_an_index_of_an_earlier_version_is_rebuilt(
    tmp_path: Path, passages: list[Passage], caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "index"
    config = IndexConfig(embedder="tfidf-svd", embedding_dim=16)
    save_index(build_index(passages, config), directory)
    manifest = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
    manifest["version"] = VERSION - 1  # built from the text as it was, not normalised
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest), encoding="utf-8")
    caplog.set_level(logging.INFO)
    ensure_index(DataLayout(tmp_path), passages, config, directory)
    assert json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))["version"] == VERSION
    assert any("building the vector index" in record.getMessage() for record in caplog.records)
