"""What a document write must be and what it answers, the same for every corpus that changes while
it serves (:class:`~specrag.pipeline.store.live_corpus.LiveCorpus`, whichever record it writes).

The checks run before anything is embedded or made durable, so a refused request changes nothing;
the limits bound what one request holds under the writer's lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from specrag.errors import InvalidInputError, NotFoundError, TooLargeError
from specrag.pipeline.store.overlay_store import Version
from specrag.retrieval.corpus import Passage
from specrag.retrieval.text import normalize_text

__all__ = [
    "MAX_BATCH_DOCUMENTS",
    "MAX_ID_CHARS",
    "MAX_TEXT_CHARS",
    "Document",
    "VersionedRows",
    "Written",
    "check_delete_batch",
    "check_document",
    "check_put_batch",
    "check_segment_lengths",
    "current_document",
    "indexed_text",
]

# One request's documents at most (a POST beyond is 413): a batch is one transaction and one
# swap, held under the writer's lock while it is embedded.
MAX_BATCH_DOCUMENTS = 1000
MAX_ID_CHARS = 256
# Ids a URL path segment cannot carry: clients and proxies resolve them as "this" and "parent".
_UNREACHABLE_IDS = frozenset({".", ".."})
MAX_TEXT_CHARS = 100_000


@dataclass(frozen=True)
class Document:
    """A document as the API shows it: its current version."""

    id: str
    title: str
    text: str
    version: int


@dataclass(frozen=True)
class Written:
    """The outcome of one document's write: its new version, whether the id was new, and whether
    searches see it yet (false: logged durably, applied once the corpus has caught up)."""

    id: str
    version: int
    created: bool
    visible: bool = True


def check_document(passage_id: object, title: object, text: object) -> Passage:
    """The passage a write names, or InvalidInputError saying what is wrong with it.

    An id must be reachable as one segment of a URL path (``/v1/documents/{id}``, which the
    client quotes whole, ``/`` included): ``.`` and ``..`` are not, a URL resolves them away, and
    an id with blanks around it would be told apart from the trimmed one by invisible characters.
    Every field must be UTF-8 text: JSON can carry a lone surrogate (``"\\ud800"``), which the
    tokenizer and the log cannot store.
    """
    if not isinstance(passage_id, str) or not passage_id.strip() or len(passage_id) > MAX_ID_CHARS:
        raise InvalidInputError(
            f"a document id must be a non-empty string of at most {MAX_ID_CHARS} characters"
        )
    _check_unicode(passage_id, f"document id {passage_id!r}")
    if any(not character.isprintable() for character in passage_id):
        raise InvalidInputError(f"document id {passage_id!r} holds unprintable characters")
    if passage_id != passage_id.strip():
        raise InvalidInputError(f"document id {passage_id!r} starts or ends with a blank")
    if passage_id in _UNREACHABLE_IDS:
        raise InvalidInputError(
            f"document id {passage_id!r} cannot be named in a URL (/v1/documents/{passage_id} "
            "resolves to another path): choose another"
        )
    if not isinstance(title, str):
        raise InvalidInputError(f"document {passage_id!r}: 'title' must be a string")
    _check_unicode(title, f"document {passage_id!r}: 'title'")
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError(f"document {passage_id!r}: 'text' must be a non-empty string")
    _check_unicode(text, f"document {passage_id!r}: 'text'")
    if len(title) + len(text) > MAX_TEXT_CHARS:
        raise TooLargeError(f"document {passage_id!r} is longer than {MAX_TEXT_CHARS} characters")
    return Passage(passage_id, title, text)


def _check_unicode(value: str, what: str) -> None:
    """InvalidInputError unless ``value`` encodes as UTF-8 (a lone surrogate does not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidInputError(
            f"{what} is not valid Unicode text: a lone surrogate at character {error.start}"
        ) from None


def indexed_text(passage: Passage) -> str:
    """What both channels index of a passage (as the index build does)."""
    return normalize_text(f"{passage.title}\n{passage.text}")


class VersionedRows(Protocol):
    """What :func:`current_document` reads: where an id stands, and a row's passage."""

    def version_of(self, passage_id: str) -> Version | None: ...

    def passage(self, row: int) -> Passage: ...


def current_document(rows: VersionedRows, passage_id: str) -> Document:
    """The current version of ``passage_id``; NotFoundError when unknown or deleted.

    One read of where the id stands (row and version together), then that row's passage: a write
    racing the read gives the old document or the new, never a mix of the two."""
    current = rows.version_of(passage_id)
    if current is None or current.row is None:
        raise NotFoundError(f"unknown document id {passage_id!r}")
    passage = rows.passage(current.row)
    return Document(passage.id, passage.title, passage.text, current.version)


def check_put_batch(passages: Sequence[Passage]) -> None:
    """InvalidInputError or TooLargeError unless ``passages`` are one request's worth (one to
    :data:`MAX_BATCH_DOCUMENTS`, each id once): a request is one transaction under the writer's lock."""
    if not passages:
        raise InvalidInputError("no documents given")
    _check_batch_size(len(passages))
    if len({passage.id for passage in passages}) < len(passages):
        raise InvalidInputError("a request names each document id once")


def check_delete_batch(passage_ids: Sequence[str]) -> None:
    """As :func:`check_put_batch` for a deletion (an id named twice is deleted once)."""
    if not passage_ids:
        raise InvalidInputError("no document ids given")
    _check_batch_size(len(passage_ids))


def _check_batch_size(count: int) -> None:
    if count > MAX_BATCH_DOCUMENTS:
        raise TooLargeError(f"at most {MAX_BATCH_DOCUMENTS} documents a request, got {count}")


def check_segment_lengths(
    passages: Sequence[Passage], tokens: Sequence[Sequence[int]], limit: int | None
) -> None:
    """TooLargeError naming the first document whose prompt segment is over ``limit`` tokens (None:
    no limit): a longer document would fit no prompt, and every query retrieving it would fail."""
    if limit is None:
        return
    for passage, token_ids in zip(passages, tokens, strict=True):
        if len(token_ids) > limit:
            raise TooLargeError(
                f"document {passage.id!r} is {len(token_ids)} tokens long; at most {limit} fit the "
                "model's context beside the system prompt, a question and the answer: split it "
                "into several documents"
            )
