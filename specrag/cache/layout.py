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
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Literal, NamedTuple

from specrag.cache.residency import chain_block_keys
from specrag.errors import InvalidInputError

__all__ = ["DocId", "PromptLayout", "Segment", "SegmentKind", "build_layout"]

DocId = int | str
"""Document identifiers as the retriever hands them out (JSON ints or strings)."""

SegmentKind = Literal["system", "document", "hint", "question"]


class Segment(NamedTuple):
    """Tokens ``[start, end)`` of the prompt; padding belongs to the segment it follows.

    A named tuple rather than a dataclass: a prompt is laid out on every request's critical
    path, and a tuple is built several times faster than a frozen dataclass instance.
    """

    kind: SegmentKind
    doc_id: DocId | None
    start: int
    end: int


_new_segment = tuple.__new__
_doc_id = itemgetter(0)


@dataclass(frozen=True, slots=True)
class PromptLayout:
    """A prompt as token IDs plus the segments it is made of, in prompt order."""

    token_ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    # The chain keys of its full blocks, per block size, once asked (see block_keys); not a field
    # of the prompt: not compared, not copied by dataclasses.replace.
    _block_keys: dict[int, tuple[int, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def block_keys(self, block_size: int) -> tuple[int, ...]:
        """The content keys of the prompt's full blocks (:func:`~specrag.cache.residency.chain_block_keys`),
        computed once per layout: a query asks for them at every replica it compares and again
        when its prompt is submitted, served and prefilled. The first ``n`` keys are those of the
        prompt's first ``n`` blocks alone, so a caller wanting a prefix's keys slices them."""
        keys = self._block_keys.get(block_size)
        if keys is None:
            keys = self._block_keys[block_size] = tuple(chain_block_keys(self.token_ids, block_size))
        return keys

    def document_ids(self) -> tuple[DocId, ...]:
        """The documents in the order they appear in the prompt."""
        return tuple(s.doc_id for s in self.segments if s.kind == "document" and s.doc_id is not None)

    def stored_spans(self, fresh: int = 0) -> tuple[tuple[int, int], ...]:
        """The non-empty system prompt and document segments before anything else, as spans,
        but for the last ``fresh`` documents.

        What a document KV store can supply (TurboRAG): each is computed alone (or after the
        system prompt) and stored; a hint or the question ends them (they are prefilled), and so
        do the last ``fresh`` documents, prefilled fresh nearest the question (tiers).
        """
        spans = []
        documents = 0
        for segment in self.segments:
            if segment.kind not in ("system", "document"):
                break
            if segment.end > segment.start:
                spans.append((segment.start, segment.end))
                documents += segment.kind == "document"
        return tuple(spans[: len(spans) - min(fresh, documents)])

    def span_tokens(self, spans: Sequence[tuple[int, int]]) -> list[tuple[int, ...]]:
        """The token IDs of each span (the segments a document KV store is filled with)."""
        return [self.token_ids[start:end] for start, end in spans]


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
    them). ``documents`` are ``(doc_id, token_ids)`` pairs already in the chosen order; token
    sequences already a block multiple (a store can keep them padded) are copied once, as they are.

    This runs on every request's critical path: the tokens are gathered into one list and copied
    once into the tuple, and segments are made by ``tuple.__new__`` (a named tuple's own
    constructor is a Python function, the slowest part of a prompt once its tokens are copied).
    """
    if block_size is not None:
        if block_size <= 0:
            raise InvalidInputError(f"block_size must be positive, got {block_size}")
        if pad_token_id is None:
            raise InvalidInputError("padding to block_size needs a pad_token_id")
    if len(set(map(_doc_id, documents))) != len(documents):
        order = [doc_id for doc_id, _ in documents]
        twice = next(d for i, d in enumerate(order) if d in order[:i])
        raise InvalidInputError(f"document {twice!r} appears twice in one prompt")
    block = block_size or 1  # every length is a multiple of 1: no padding
    pad = (0 if pad_token_id is None else pad_token_id,)
    tokens = [*system_token_ids]
    if missing := -len(tokens) % block:
        tokens += pad * missing
    end = len(tokens)
    segments = [_new_segment(Segment, ("system", None, 0, end))]
    add = segments.append
    for doc_id, ids in documents:
        start = end
        tokens += ids
        end = len(tokens)
        if missing := -end % block:
            tokens += pad * missing
            end += missing
        add(_new_segment(Segment, ("document", doc_id, start, end)))
    if hint_token_ids:
        tokens += hint_token_ids
        add(_new_segment(Segment, ("hint", None, end, len(tokens))))
        end = len(tokens)
    tokens += question_token_ids
    add(_new_segment(Segment, ("question", None, end, len(tokens))))
    return PromptLayout(tuple(tokens), tuple(segments))
