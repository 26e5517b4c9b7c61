"""Prompt assembly from stored token segments: exact segments, block alignment, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrag.errors import ArtifactError, InvalidInputError
from specrag.pipeline.models.tokenizer import Tokenizer
from specrag.pipeline.store.document_store import DocumentStore, build_store
from specrag.pipeline.store.prompt import MAX_QUESTION_CHARS, QUESTION_RESERVE_TOKENS, PromptBuilder
from specrag.retrieval.corpus import Passage
from tests.helpers.models import store_of


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def store(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer, default_corpus: list[Passage]
) -> DocumentStore:
    return store_of(tmp_path_factory.mktemp("store") / "s.sqlite", default_corpus[:20], tokenizer)


def test_prompt_is_the_concatenation_of_stored_segments(tokenizer: Tokenizer, store: DocumentStore) -> None:
    builder = PromptBuilder(tokenizer, store, system_prompt="System.\n", block_size=None)
    layout = builder.build([3, 1, 7], "What is an assert?")
    expected = (
        list(tokenizer.encode("System.\n"))
        + list(store.tokens(3))
        + list(store.tokens(1))
        + list(store.tokens(7))
        + builder.question_tokens("What is an assert?")
    )
    assert list(layout.token_ids) == expected
    assert layout.document_ids() == (3, 1, 7)


def test_stored_segments_are_not_retokenized_across_boundaries(
    tokenizer: Tokenizer, store: DocumentStore
) -> None:
    layout = PromptBuilder(tokenizer, store).build([0, 1], "q?")
    documents = [s for s in layout.segments if s.kind == "document"]
    for segment, row in zip(documents, (0, 1), strict=True):
        assert layout.token_ids[segment.start : segment.end] == store.tokens(row)


def test_block_alignment_puts_every_document_on_a_block_boundary(
    tokenizer: Tokenizer, store: DocumentStore
) -> None:
    builder = PromptBuilder(tokenizer, store, block_size=32)
    layout = builder.build([5, 2, 9], "Why?")
    for segment in layout.segments:
        if segment.kind in ("system", "document"):
            assert segment.start % 32 == 0 and segment.end % 32 == 0
    # Two prompts that differ from the second document on share exactly the aligned prefix.
    other = builder.build([5, 4, 9], "Why?")
    shared = next(
        i for i, (a, b) in enumerate(zip(layout.token_ids, other.token_ids, strict=False)) if a != b
    )
    assert shared >= layout.segments[1].end
    assert builder.system_layout_tokens() == layout.token_ids[: layout.segments[0].end]


def test_bad_questions_are_rejected(tokenizer: Tokenizer, store: DocumentStore) -> None:
    builder = PromptBuilder(tokenizer, store)
    with pytest.raises(InvalidInputError, match="empty"):
        builder.build([0], "   ")
    with pytest.raises(InvalidInputError, match="longer than"):
        builder.build([0], "x" * (MAX_QUESTION_CHARS + 1))
    with pytest.raises(InvalidInputError, match="out of range"):
        builder.build([len(store)], "q")
    with pytest.raises(InvalidInputError, match="appears twice"):
        builder.build([1, 1], "q")
    with pytest.raises(InvalidInputError, match="must contain"):
        PromptBuilder(tokenizer, store, question_template="no placeholder")


def test_a_store_of_another_tokenizer_is_refused(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = tmp_path / "s.sqlite"
    build_store(path, [Passage("a", "t", "text")], tokenizer.encode_batch, tokenizer_fingerprint="other")
    with pytest.raises(ArtifactError, match="built for tokenizer other"):
        PromptBuilder(tokenizer, DocumentStore(path))


def test_the_document_token_limit_leaves_room_for_system_question_answer_and_padding(
    tokenizer: Tokenizer, store: DocumentStore
) -> None:
    builder = PromptBuilder(tokenizer, store, block_size=16)
    system = len(builder.system_layout_tokens())
    assert builder.document_token_limit(1024, 64) == 1024 - system - QUESTION_RESERVE_TOKENS - 64 - 16
    unpadded = PromptBuilder(tokenizer, store)
    assert unpadded.document_token_limit(1024, 64) == 1024 - len(unpadded.system_layout_tokens()) - 256 - 64
