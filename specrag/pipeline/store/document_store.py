"""The document store: passages and their token IDs, in one SQLite file.

Each passage is tokenized once, at ingest, as the exact segment it becomes in a prompt. Prompts are
then assembled by concatenating stored token segments, never by re-tokenizing a concatenated
string: a BPE merge across a document boundary would change tokens, and one changed token breaks
every prefix-cache block after it. Token IDs depend on the tokenizer, so the store records the
tokenizer's fingerprint and the segment template and refuses to serve another tokenizer.

Rows are positional: row ``i`` is passage ``i`` of the corpus, the same integer the vector index
returns. Every row carries a checksum that each read verifies (:mod:`specrag.pipeline.store.checksums`):
a damaged row is an :class:`ArtifactError` naming the file, never different tokens in a prompt.
This module knows nothing of models: the tokenizer is a function handed in.
"""

from __future__ import annotations

import functools
import hashlib
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrag.atomic import atomic_file
from specrag.errors import ArtifactError, InvalidInputError
from specrag.pipeline.store.checksums import damaged_row, row_checksum, verify_row
from specrag.retrieval.corpus import Passage

__all__ = [
    "DEFAULT_SEGMENT_TEMPLATE",
    "SCHEMA_VERSION",
    "DocumentStore",
    "StoreInfo",
    "TokenizeBatch",
    "build_store",
    "corpus_checksum",
    "render_segment",
]

# How a passage appears in a prompt. Stored with the tokens: changing it requires a rebuild. The
# label is the one order and location hints name the passage by (specrag.cache.hints: its row).
DEFAULT_SEGMENT_TEMPLATE = "[Doc {row}] {title}\n{text}\n\n"
# 2: a checksum per row, verified on every read.
SCHEMA_VERSION = "2"
_TOKEN_DTYPE = np.dtype("<u4")
_TOKENIZE_BATCH = 256

TokenizeBatch = Callable[[list[str]], list[list[int]]]


@dataclass(frozen=True)
class StoreInfo:
    """What a store was built from; compared on open so a stale store is never used silently."""

    tokenizer_fingerprint: str
    segment_template: str
    corpus_checksum: str
    passages: int
    total_tokens: int


def corpus_checksum(passages: Sequence[Passage]) -> str:
    """SHA-256 over ids, titles and texts in order: identifies the corpus a store or index was built on."""
    digest = hashlib.sha256()
    for passage in passages:
        for part in (passage.id, passage.title, passage.text):
            encoded = part.encode("utf-8")
            digest.update(len(encoded).to_bytes(8, "little"))
            digest.update(encoded)
    return digest.hexdigest()


def render_segment(row: int, passage: Passage, template: str = DEFAULT_SEGMENT_TEMPLATE) -> str:
    return template.format(row=row, title=passage.title, text=passage.text)


class DocumentStore:
    """Read access to a built store; safe to share between threads (reads only)."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise ArtifactError(f"document store not found: {path}")
        self.path = path
        try:
            self._connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
            meta = dict(self._connection.execute("SELECT key, value FROM meta").fetchall())
            self.info = StoreInfo(
                tokenizer_fingerprint=meta["tokenizer_fingerprint"],
                segment_template=meta["segment_template"],
                corpus_checksum=meta["corpus_checksum"],
                passages=int(meta["passages"]),
                total_tokens=int(meta["total_tokens"]),
            )
            if meta.get("schema_version") != SCHEMA_VERSION:
                raise ArtifactError(
                    f"{path}: schema version {meta.get('schema_version')} is not {SCHEMA_VERSION}"
                )
            (rows,) = self._connection.execute("SELECT COUNT(*) FROM passages").fetchone()
        except (sqlite3.DatabaseError, KeyError, ValueError) as error:
            raise ArtifactError(f"document store {path} is corrupt or incomplete: {error}") from error
        if rows != self.info.passages:
            raise ArtifactError(
                f"document store {path} holds {rows} passages, its manifest says {self.info.passages}"
            )
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.info.passages

    def check_matches(
        self, tokenizer_fingerprint: str, corpus: str | None = None, segment_template: str | None = None
    ) -> None:
        """Raise if the store was built for another tokenizer or (when given) another corpus checksum
        or segment template."""
        if self.info.tokenizer_fingerprint != tokenizer_fingerprint:
            raise ArtifactError(
                f"document store {self.path} was built for tokenizer {self.info.tokenizer_fingerprint}, "
                f"not {tokenizer_fingerprint}: rebuild it"
            )
        if corpus is not None and self.info.corpus_checksum != corpus:
            raise ArtifactError(f"document store {self.path} was built from another corpus: rebuild it")
        if segment_template is not None and self.info.segment_template != segment_template:
            raise ArtifactError(f"document store {self.path} lays passages out another way: rebuild it")

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.info.passages:
            raise InvalidInputError(f"passage row {row} out of range [0, {self.info.passages})")

    def _verified_row(self, row: int) -> tuple[str, str, str, int, bytes, bytes]:
        """Every field of ``row``, checked against its checksum before anything uses it."""
        self._check_row(row)
        try:
            with self._lock:
                found = self._connection.execute(
                    "SELECT id, title, text, n_tokens, tokens, checksum FROM passages WHERE row = ?", (row,)
                ).fetchone()
        except sqlite3.DatabaseError as error:  # a damaged page, or text that no longer decodes
            raise damaged_row(self.path, row, f"cannot be read ({error})") from error
        if found is None:
            raise damaged_row(self.path, row, "is missing")
        verify_row(self.path, row, found)
        return found

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - the store lives as long as the service
    def tokens(self, row: int) -> tuple[int, ...]:
        """Token IDs of passage ``row`` as it appears in a prompt (cached: prompts reuse passages)."""
        blob = self._verified_row(row)[4]
        return tuple(int(token) for token in np.frombuffer(blob, dtype=_TOKEN_DTYPE))

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - as tokens: a row never changes
    def passage(self, row: int) -> Passage:
        """Passage ``row`` (cached: every answer names its sources, read from here)."""
        passage_id, title, text, *_ = self._verified_row(row)
        return Passage(id=passage_id, title=title, text=text)

    def passage_ids(self) -> list[str]:
        """The passage ids in row order: what a changed corpus is compared with."""
        try:
            with self._lock:
                return [
                    found[0] for found in self._connection.execute("SELECT id FROM passages ORDER BY row")
                ]
        except sqlite3.DatabaseError as error:
            raise ArtifactError(f"document store {self.path} is corrupt: {error}") from error

    def row_of(self, passage_id: str) -> int:
        with self._lock:
            found = self._connection.execute(
                "SELECT row FROM passages WHERE id = ?", (passage_id,)
            ).fetchone()
        if found is None:
            raise InvalidInputError(f"unknown passage id {passage_id!r}")
        return int(found[0])

    def close(self) -> None:
        self._connection.close()


def build_store(
    path: Path,
    passages: Sequence[Passage],
    tokenize_batch: TokenizeBatch,
    tokenizer_fingerprint: str,
    segment_template: str = DEFAULT_SEGMENT_TEMPLATE,
    progress: Callable[[int], object] | None = None,
) -> StoreInfo:
    """Tokenize every passage's prompt segment and write the store atomically.

    ``progress`` is called with the number of passages done after each batch (for a progress bar).
    """
    if not passages:
        raise InvalidInputError("cannot build a document store from an empty corpus")
    total_tokens = 0
    with atomic_file(path) as staging:
        connection = sqlite3.connect(staging)
        try:
            connection.executescript(
                """
                CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
                CREATE TABLE passages (
                    row INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, title TEXT NOT NULL,
                    text TEXT NOT NULL, n_tokens INTEGER NOT NULL, tokens BLOB NOT NULL,
                    checksum BLOB NOT NULL);
                """
            )
            for start in range(0, len(passages), _TOKENIZE_BATCH):
                batch = passages[start : start + _TOKENIZE_BATCH]
                token_lists = tokenize_batch(
                    [render_segment(start + offset, p, segment_template) for offset, p in enumerate(batch)]
                )
                rows = []
                for offset, (passage, token_ids) in enumerate(zip(batch, token_lists, strict=True)):
                    array = np.asarray(token_ids, dtype=_TOKEN_DTYPE)
                    total_tokens += len(array)
                    row, blob = start + offset, array.tobytes()
                    checksum = row_checksum(row, passage.id, passage.title, passage.text, blob)
                    rows.append((row, passage.id, passage.title, passage.text, len(array), blob, checksum))
                connection.executemany("INSERT INTO passages VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
                if progress is not None:
                    progress(start + len(batch))
            info = StoreInfo(
                tokenizer_fingerprint=tokenizer_fingerprint,
                segment_template=segment_template,
                corpus_checksum=corpus_checksum(passages),
                passages=len(passages),
                total_tokens=total_tokens,
            )
            meta = {
                "schema_version": SCHEMA_VERSION,
                "tokenizer_fingerprint": info.tokenizer_fingerprint,
                "segment_template": info.segment_template,
                "corpus_checksum": info.corpus_checksum,
                "passages": str(info.passages),
                "total_tokens": str(info.total_tokens),
            }
            connection.executemany("INSERT INTO meta VALUES (?, ?)", meta.items())
            connection.commit()
        finally:
            connection.close()
    return info
