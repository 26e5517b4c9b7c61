"""The SQLite document store: token segments stored at ingest, checked on open."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from specrag.errors import ArtifactError, InvalidInputError
from specrag.pipeline.store.document_store import (
    DEFAULT_SEGMENT_TEMPLATE,
    DocumentStore,
    build_store,
    corpus_checksum,
    render_segment,
)
from specrag.retrieval.corpus import Passage

PASSAGES = [Passage(id=f"p{i}", title=f"T{i}", text=f"text number {i} " * (i + 1)) for i in range(10)]


def byte_tokenize(texts: list[str]) -> list[list[int]]:
    """A stand-in tokenizer whose output is easy to predict: one token per UTF-8 byte."""
    return [list(text.encode("utf-8")) for text in texts]


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    path = tmp_path / "store" / "s.sqlite"
    build_store(path, PASSAGES, byte_tokenize, tokenizer_fingerprint="fp1")
    return path


def test_tokens_are_the_rendered_segment_tokens(store_path: Path) -> None:
    store = DocumentStore(store_path)
    assert len(store) == len(PASSAGES)
    for row, passage in enumerate(PASSAGES):
        assert store.tokens(row) == tuple(render_segment(row, passage).encode("utf-8"))
        assert f"[Doc {row}]" in render_segment(row, passage)  # the label hints name it by
        assert store.passage(row) == passage
        assert store.row_of(passage.id) == row
    assert store.info.total_tokens == sum(len(render_segment(r, p).encode()) for r, p in enumerate(PASSAGES))
    assert store.info.corpus_checksum == corpus_checksum(PASSAGES)


def test_store_refuses_another_tokenizer_or_corpus(store_path: Path) -> None:
    store = DocumentStore(store_path)
    store.check_matches("fp1", corpus_checksum(PASSAGES))
    with pytest.raises(ArtifactError, match="built for tokenizer fp1"):
        store.check_matches("fp2")
    with pytest.raises(ArtifactError, match="another corpus"):
        store.check_matches("fp1", corpus_checksum(PASSAGES[:3]))
    store.check_matches("fp1", segment_template=DEFAULT_SEGMENT_TEMPLATE)
    with pytest.raises(ArtifactError, match="another way"):
        store.check_matches("fp1", segment_template="## {title}\n{text}\n\n")


def test_out_of_range_rows_and_unknown_ids(store_path: Path) -> None:
    store = DocumentStore(store_path)
    with pytest.raises(InvalidInputError, match="out of range"):
        store.tokens(len(PASSAGES))
    with pytest.raises(InvalidInputError, match="out of range"):
        store.passage(-1)
    with pytest.raises(InvalidInputError, match="unknown passage id"):
        store.row_of("missing")


def test_missing_truncated_and_inconsistent_stores_name_the_file(store_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not found"):
        DocumentStore(tmp_path / "absent.sqlite")
    truncated = tmp_path / "truncated.sqlite"
    truncated.write_bytes(store_path.read_bytes()[:1000])
    with pytest.raises(ArtifactError, match=r"truncated\.sqlite"):
        DocumentStore(truncated)
    connection = sqlite3.connect(store_path)
    connection.execute("DELETE FROM passages WHERE row = 3")
    connection.commit()
    connection.close()
    with pytest.raises(ArtifactError, match="holds 9 passages"):
        DocumentStore(store_path)


def test_a_failed_build_leaves_the_previous_store_intact(store_path: Path) -> None:
    def failing(texts: list[str]) -> list[list[int]]:
        raise RuntimeError("tokenizer crashed")

    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        build_store(store_path, PASSAGES[:2], failing, tokenizer_fingerprint="fp9")
    assert DocumentStore(store_path).info.tokenizer_fingerprint == "fp1"
    assert sorted(p.name for p in store_path.parent.iterdir()) == [
        f".{store_path.name}.lock",
        store_path.name,
    ]


def test_empty_corpus_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="empty corpus"):
        build_store(tmp_path / "s.sqlite", [], byte_tokenize, tokenizer_fingerprint="fp")


def flip_byte_of(path: Path, needle: bytes, offset: int = 0) -> None:
    """Flip one bit in the file where ``needle`` sits: damage SQLite does not notice."""
    data = bytearray(path.read_bytes())
    at = data.index(needle) + offset
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_rows_tokens_never_reaches_a_prompt(store_path: Path) -> None:
    """the store opens, but the damaged row is an error naming the file and the command,
    never different tokens."""
    segment = render_segment(3, PASSAGES[3]).encode("utf-8")
    token_bytes = b"".join(byte.to_bytes(4, "little") for byte in segment[:12])
    flip_byte_of(store_path, token_bytes, offset=5)
    store = DocumentStore(store_path)
    with pytest.raises(ArtifactError, match=rf"{store_path}.*row 3.*checksum.*specrag prepare"):
        store.tokens(3)
    assert store.tokens(2) == tuple(render_segment(2, PASSAGES[2]).encode("utf-8"))


def test_a_flipped_byte_in_a_rows_text_is_found_too(store_path: Path) -> None:
    flip_byte_of(store_path, PASSAGES[5].text.encode("utf-8"), offset=3)
    store = DocumentStore(store_path)
    with pytest.raises(ArtifactError, match="row 5"):
        store.passage(5)
    with pytest.raises(ArtifactError, match="row 5"):
        store.tokens(5)


def test_token_data_of_the_wrong_length_is_a_clear_error(store_path: Path) -> None:
    with sqlite3.connect(store_path) as connection:
        connection.execute("UPDATE passages SET tokens = substr(tokens, 1, 6) WHERE row = 1")
    with pytest.raises(ArtifactError, match="row 1 holds token data of the wrong length"):
        DocumentStore(store_path).tokens(1)
