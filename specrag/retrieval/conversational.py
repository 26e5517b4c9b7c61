"""A follow-up question searched with its conversation.

A follow-up such as "And which of its methods closes the connection?" does not name what it asks
about: its subject is in the questions before it. Searched alone, it finds passages about closing
connections in general. So a follow-up is searched with the previous questions joined to it, in
both channels and each weighing less than the question itself, so that the question still decides
what the passages are about and the earlier ones only say about whom:

- dense: the unit vector along the question's embedding plus each previous question's, the
  previous one weighted :data:`PREVIOUS_QUESTION_WEIGHT`, the one before it that weight squared;
- lexical: BM25 sums a score per query term, so the question's text is given as many times more
  than the previous questions' as the dense weights say (Lucene's ``term^n``, in whole numbers).

Only the last :data:`CONVERSATION_TURNS` questions are joined: a conversation's subject is in its
recent turns, and an old one would pull the search back to a subject the user left. The weight
was chosen on ``bench.retrieval.conversations`` (docs/retrieval.md, "Follow-up questions"), which
also measures what joining costs a follow-up that changes the subject.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval.arrays import unit_rows
from specrag.retrieval.embedders.http_embedder import LoopEmbedder
from specrag.retrieval.text import normalize_text
from specrag.retrieval.vector_index import VectorIndex

__all__ = [
    "CONVERSATION_TURNS",
    "PREVIOUS_QUESTION_WEIGHT",
    "ConversationQuery",
    "conversation_query",
    "conversation_query_on_loop",
    "question_weights",
]

CONVERSATION_TURNS = 2
PREVIOUS_QUESTION_WEIGHT = 0.5


@dataclass(frozen=True)
class ConversationQuery:
    """What a question is searched with: its query vector, its lexical text, and how many previous
    questions both hold."""

    vector: np.ndarray
    text: str
    joined: int


def question_weights(joined: int, weight: float = PREVIOUS_QUESTION_WEIGHT) -> list[float]:
    """The weights of the ``joined`` previous questions (oldest first), then the question's (1)."""
    if not 0 <= weight <= 1:
        raise InvalidInputError(f"the previous question's weight must be within [0, 1], got {weight}")
    return [weight ** (joined - position) for position in range(joined)] + [1.0]


def conversation_query(
    index: VectorIndex,
    question: str,
    previous: Sequence[str] = (),
    weight: float = PREVIOUS_QUESTION_WEIGHT,
    turns: int = CONVERSATION_TURNS,
) -> ConversationQuery:
    """``question`` joined with the last ``turns`` of the ``previous`` questions (oldest first).

    With no previous question, or a weight of 0, it is the question alone, as a first turn is
    searched.
    """
    if turns < 0:
        raise InvalidInputError(f"turns must be at least 0, got {turns}")
    recent = _recent(previous, weight, turns)
    texts = [*recent, question]
    if not recent:
        return ConversationQuery(index.embed_query(question), question, 0)
    weights = question_weights(len(recent), weight)
    vectors = np.stack([index.embed_query(text) for text in texts])
    vector = unit_rows((np.asarray(weights)[:, None] * vectors).sum(axis=0, keepdims=True))[0]
    smallest = min(weights)
    repeats = [max(1, round(w / smallest)) for w in weights]
    text = "\n".join(part for part, times in zip(texts, repeats, strict=True) for part in [part] * times)
    return ConversationQuery(vector.astype(vectors.dtype), text, len(recent))


async def conversation_query_on_loop(
    index: VectorIndex, question: str, previous: Sequence[str] = ()
) -> ConversationQuery:
    """:func:`conversation_query` from an event loop without blocking it: a first turn whose
    embedder is a server is asked on the loop itself (no thread hops); anything else (a model
    embedding in this process, a follow-up's several questions) runs on a worker thread."""
    embedder = index.embedder
    if _asked_on_loop(embedder) and not _recent(previous):
        served = cast(LoopEmbedder, embedder)
        vector: np.ndarray = (await served.embed_async([normalize_text(question)]))[0]
        return ConversationQuery(vector, question, 0)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, conversation_query, index, question, previous)


_ASKED_ON_LOOP: dict[type, bool] = {}
"""Per embedder class, whether it is awaited on the loop: a protocol's ``isinstance`` walks its
members on every call, a visible cost once per question, and a class's answer never changes."""


def _asked_on_loop(embedder: object) -> bool:
    kind = type(embedder)
    if kind not in _ASKED_ON_LOOP:
        _ASKED_ON_LOOP[kind] = isinstance(embedder, LoopEmbedder)
    return _ASKED_ON_LOOP[kind]


def _recent(
    previous: Sequence[str], weight: float = PREVIOUS_QUESTION_WEIGHT, turns: int = CONVERSATION_TURNS
) -> list[str]:
    """The previous questions a follow-up is joined with (none for a first turn)."""
    return [text for text in previous[-turns:] if text.strip()] if turns and weight else []
