"""Corpus splitting, the default corpus and JSONL loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specrag.errors import ArtifactError, InvalidInputError
from specrag.retrieval.corpus import (
    MIN_PASSAGE_WORDS,
    Passage,
    build_default_corpus,
    load_passages,
    split_text,
    write_passages,
)

words = st.lists(st.sampled_from(["alpha", "beta.", "gamma!", "delta", "eps?"]), min_size=0, max_size=900)


@given(words=words, breaks=st.lists(st.integers(min_value=0, max_value=900), max_size=20))
def test_split_keeps_every_word_in_order(words: list[str], breaks: list[int]) -> None:
    chunks = list(words)
    for position in sorted(set(breaks), reverse=True):
        if position < len(chunks):
            chunks.insert(position, "\n\n")
    text = " ".join(chunks)
    pieces = split_text(text, target_words=60)
    assert " ".join(pieces).split() == text.split()


@given(words=words)
def test_split_bounds_passage_length(words: list[str]) -> None:
    pieces = split_text(" ".join(words), target_words=60)
    for piece in pieces:
        # A merged short tail may push the last chunk past the target, never past target + minimum.
        assert len(piece.split()) < 60 + MIN_PASSAGE_WORDS
    for piece in pieces[:-1]:
        assert len(piece.split()) <= 60


def test_split_rejects_a_tiny_target() -> None:
    with pytest.raises(InvalidInputError, match="target_words"):
        split_text("some words", target_words=5)


def test_default_corpus_is_deterministic_with_unique_ids(default_corpus: list[Passage]) -> None:
    assert len(default_corpus) > 1000
    ids = [passage.id for passage in default_corpus]
    assert len(set(ids)) == len(ids)
    assert build_default_corpus()[:50] == default_corpus[:50]
    assert any(passage.id.startswith("topic/") for passage in default_corpus)
    assert any(passage.id.startswith("doc/asyncio") for passage in default_corpus)
    assert all(passage.text.strip() and passage.title for passage in default_corpus)


def test_jsonl_round_trip(tmp_path: Path) -> None:
    passages = [Passage(id="a", title="A", text="first text"), Passage(id="b", title="", text="second")]
    path = tmp_path / "corpus" / "p.jsonl"
    assert write_passages(path, passages) == 2
    assert load_passages(path) == passages


def test_integer_ids_load_as_strings(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": 7, "title": "t", "text": "x"}) + "\n")
    assert load_passages(path) == [Passage(id="7", title="t", text="x")]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"id": "a", "text": "x"}\nnot json\n', r"p.jsonl:2: not valid JSON"),
        (
            '{"id": "a", "text": "cut sh',  # a last line cut short
            r"p.jsonl:1: not valid JSON \(Unterminated string starting at: column 21\)",
        ),
        ('["a", "b"]\n', r"p.jsonl:1: expected a JSON object"),
        ('{"text": "x"}\n', r"p.jsonl:1: 'id' must be"),
        ('{"id": true, "text": "x"}\n', r"p.jsonl:1: 'id' must be"),
        ('{"id": "a", "text": "  "}\n', r"p.jsonl:1: 'text' must be"),
        ('{"id": "a", "text": "x", "title": 3}\n', r"p.jsonl:1: 'title' must be"),
        ('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n', r"p.jsonl:2: duplicate id 'a'"),
        ("\n\n", r"has no passages"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ArtifactError, match=message):
        load_passages(path)


def test_missing_corpus_file(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="corpus file not found"):
        load_passages(tmp_path / "nope.jsonl")


def test_write_refuses_duplicate_ids_and_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    with pytest.raises(InvalidInputError, match="duplicate"):
        write_passages(path, [Passage("a", "", "x"), Passage("a", "", "y")])
    assert not path.exists()
