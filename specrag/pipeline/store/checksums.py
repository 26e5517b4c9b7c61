"""Row checksums of the document store: a damaged passage is an error, never a wrong prompt.

SQLite checks its own page structure but not the bytes inside a row: one flipped bit in a
passage's token data reads back as a different token, which would go into every prompt that uses
the passage. So each row carries a BLAKE2b digest of everything a prompt or a citation takes from
it (row number, id, title, text and the token bytes), written at build time and checked on every
read, before the row is used. docs/reliability.md says why a per-row check rather than a digest
of the whole file at open, and what each costs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from specrag.errors import ArtifactError

__all__ = ["CHECKSUM_BYTES", "TOKEN_BYTES", "damaged_row", "row_checksum", "verify_row"]

CHECKSUM_BYTES = 16
# The store keeps token IDs as little-endian uint32.
TOKEN_BYTES = 4


def row_checksum(row: int, passage_id: str, title: str, text: str, tokens: bytes) -> bytes:
    """The digest of one row: each field length-prefixed, so no two rows share one by shifting bytes."""
    digest = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    digest.update(row.to_bytes(8, "little", signed=True))
    for part in (passage_id.encode("utf-8"), title.encode("utf-8"), text.encode("utf-8"), tokens):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.digest()


def damaged_row(path: Path, row: int, why: str) -> ArtifactError:
    """The error a damaged row raises: names the file, the row and what to run."""
    return ArtifactError(
        f"document store {path}: passage row {row} {why} (the file is damaged); delete {path} and run "
        "`specrag prepare` to rebuild it"
    )


def verify_row(
    path: Path,
    row: int,
    fields: tuple[str, str, str, int, bytes, bytes],
) -> None:
    """Raise :func:`damaged_row` unless ``(id, title, text, n_tokens, tokens, checksum)`` of
    ``row`` are what was written."""
    passage_id, title, text, n_tokens, tokens, checksum = fields
    if not isinstance(tokens, bytes) or len(tokens) != n_tokens * TOKEN_BYTES:
        raise damaged_row(path, row, f"holds token data of the wrong length for its {n_tokens} tokens")
    if checksum != row_checksum(row, passage_id, title, text, tokens):
        raise damaged_row(path, row, "does not match its checksum")
