"""The prompt layout contract between the cache layer and specrag.pipeline.

Prompts are built as token IDs from per-document token segments (never by tokenizing a joined
string, which lets tokens merge across document boundaries and shifts every later KV block).
The layout records where each segment lies so the knowledge tree can map documents to the
engine's KV blocks. Optional padding puts the system prompt and every document on a KV-block
boundary: two prompts that diverge at a document boundary then diverge at a block boundary, so
APC keeps every block of the shared prefix instead of losing the straddling one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from specrag.errors import InvalidInputError

DocId = int | str
"""Document identifiers as the retriever hands them out (JSON ints or strings)."""

SegmentKind = Literal["system", "document", "hint", "question"]


@dataclass(frozen=True, slots=True)
class Segment:
    """Tokens ``[start, end)`` of the prompt; padding belongs to the segment it follows."""

    kind: SegmentKind
    doc_id: DocId | None
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class PromptLayout:
    """A prompt as token IDs plus the segments it is made of, in prompt order."""

    token_ids: tuple[int, ...]
    segments: tuple[Segment, ...]

    def document_ids(self) -> tuple[DocId, ...]:
        """The documents in the order they appear in the prompt."""
        return tuple(s.doc_id for s in self.segments if s.kind == "document" and s.doc_id is not None)


def _padding(length: int, block_size: int | None) -> int:
    return 0 if block_size is None else -length % block_size


def build_layout(
    system_token_ids: Sequence[int],
    documents: Sequence[tuple[DocId, Sequence[int]]],
    question_token_ids: Sequence[int],
    hint_token_ids: Sequence[int] | None = None,
    *,
    block_size: int | None = None,
    pad_token_id: int | None = None,
) -> PromptLayout:
    """Lay out ``system · documents · hint · question`` as one token-ID prompt.

    With ``block_size`` set, the system prompt and each document are padded with ``pad_token_id``
    to a multiple of the block size (the hint and the question are not: nothing is shared after
    them). ``documents`` are ``(doc_id, token_ids)`` pairs already in the chosen order.
    """
    if block_size is not None:
        if block_size <= 0:
            raise InvalidInputError(f"block_size must be positive, got {block_size}")
        if pad_token_id is None:
            raise InvalidInputError("padding to block_size needs a pad_token_id")
    pad_id = 0 if pad_token_id is None else pad_token_id
    tokens: list[int] = []
    segments: list[Segment] = []

    def add(kind: SegmentKind, doc_id: DocId | None, ids: Sequence[int], padded: bool) -> None:
        start = len(tokens)
        tokens.extend(ids)
        if padded and (pad := _padding(len(tokens), block_size)):
            tokens.extend((pad_id,) * pad)
        segments.append(Segment(kind, doc_id, start, len(tokens)))

    add("system", None, system_token_ids, True)
    seen: set[DocId] = set()
    for doc_id, ids in documents:
        if doc_id in seen:
            raise InvalidInputError(f"document {doc_id!r} appears twice in one prompt")
        seen.add(doc_id)
        add("document", doc_id, ids, True)
    if hint_token_ids:
        add("hint", None, hint_token_ids, False)
    add("question", None, question_token_ids, False)
    return PromptLayout(tuple(tokens), tuple(segments))
