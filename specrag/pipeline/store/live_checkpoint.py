"""The document log's checkpoint at start: history dropped, rows numbered anew, vectors checked.

Run once, before the replay and before anything refers to a row of the log (the index holds the
base's): it reads the log once, keeps each id's last change only, numbers the kept rows anew right
after the base's (re-tokenizing the rows that moved, as the live corpus tokenizes a new version),
checks that the index's embedder made the logged vectors, and rewrites the log to match. So a start
costs time and memory in proportion to the live corpus, not to its history. The live store
(:meth:`~specrag.pipeline.store.live_store.LiveStore.checkpoint`) takes the result into memory.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from specrag.errors import ArtifactError
from specrag.pipeline.store.document_store import TokenizeBatch, render_segment
from specrag.pipeline.store.live_log import (
    COLUMNS,
    TOKEN_DTYPE,
    Change,
    log_meta,
    record_of,
    truncate_wal,
    verified_change,
)
from specrag.retrieval.corpus import Passage

if TYPE_CHECKING:
    from specrag.retrieval.embedders.embedder import Embedder

__all__ = ["EMBEDDER_AGREEMENT", "Checkpointed", "checkpoint_log", "cosine"]

logger = logging.getLogger(__name__)

# The least cosine between a logged vector and the same text embedded again by the index's
# embedder: the same embedder agrees up to rounding, another one (even of the same kind and
# dimension, fitted on another corpus) lies far off.
EMBEDDER_AGREEMENT = 0.99
_TOKENIZE_BATCH = 256


@dataclass(frozen=True)
class Checkpointed:
    """The log after its checkpoint: each id's last change (in log order, on its new row), and the
    token bytes of the segments whose document KV is of no further use (superseded or moved)."""

    changes: list[Change]
    dropped: list[bytes]


def cosine(one: np.ndarray, other: np.ndarray) -> float:
    """The cosine of two vectors (0 when their shapes differ or one is zero): at least
    :data:`EMBEDDER_AGREEMENT` when one embedder made both of one text."""
    norms = float(np.linalg.norm(one) * np.linalg.norm(other))
    return float(one @ other) / norms if one.shape == other.shape and norms else 0.0


def checkpoint_log(
    log: sqlite3.Connection,
    log_path: Path,
    base_rows: int,
    segment_template: str,
    tokenize_batch: TokenizeBatch,
    embedder: Embedder | None = None,
    indexed_text: Callable[[Passage], str] | None = None,
) -> Checkpointed:
    """Checkpoint the log (module doc); ``base_rows`` is the base store's size,
    ``indexed_text`` what ``embedder`` embeds of a passage."""
    kept: dict[str, tuple[Any, ...]] = {}
    dropped: list[bytes] = []  # the tokens of superseded rows: their KV is of no further use
    for found in log.execute(f"SELECT {COLUMNS} FROM changes ORDER BY seq"):
        previous = kept.get(found[1])
        if previous is not None and previous[6]:
            dropped.append(previous[6])
        kept[found[1]] = found
    logged = sorted(kept.values(), key=lambda found: found[0])
    changes = [verified_change(log_path, found) for found in logged]
    identity = _check_embedder(log, log_path, changes, embedder, indexed_text)
    changes, moved = _renumbered(changes, base_rows, segment_template, tokenize_batch)
    _rewrite(
        log,
        log_path,
        [(seq, change) for (seq, *_), change in zip(logged, changes, strict=True)],
        moved,
        identity,
    )
    dropped += [old for old, _ in moved.values()]
    return Checkpointed(changes, dropped)


def _check_embedder(
    log: sqlite3.Connection,
    log_path: Path,
    changes: Sequence[Change],
    embedder: Embedder | None,
    indexed_text: Callable[[Passage], str] | None,
) -> dict[str, str]:
    """The identity of ``embedder`` to record; ArtifactError if it did not make the logged vectors."""
    if embedder is None:
        return {}
    identity = {"embedder_kind": str(getattr(embedder, "kind", type(embedder).__name__))}
    identity["embedder_dim"] = str(embedder.dim)
    live = [change for change in changes if change.row is not None]
    if not live:
        return identity
    recorded = log_meta(log)
    if any(recorded.get(key, value) != value for key, value in identity.items()):
        why = (
            f"were made by the embedder {recorded.get('embedder_kind')} "
            f"({recorded.get('embedder_dim')} dimensions), the index's is {identity['embedder_kind']} "
            f"({identity['embedder_dim']} dimensions)"
        )
    else:
        probe = live[-1]
        assert probe.passage is not None and probe.vector is not None and indexed_text is not None
        again = np.asarray(embedder.embed([indexed_text(probe.passage)]), dtype=np.float32)[0]
        agreement = cosine(again, probe.vector)
        if agreement >= EMBEDDER_AGREEMENT:
            return identity
        why = (
            f"are not what the index's embedder ({identity['embedder_kind']}) makes: document "
            f"{probe.id!r} embedded again agrees with its logged vector to a cosine of {agreement:.3f}"
        )
    raise ArtifactError(
        f"the vectors of the {len(live)} documents in the document log {log_path} {why}: the "
        "index was rebuilt with another embedder since they were written. Serve the index they were "
        "written for, or move the log aside and add its documents again (`specrag documents add`)"
    )


def _renumbered(
    changes: list[Change], base_rows: int, template: str, tokenize_batch: TokenizeBatch
) -> tuple[list[Change], dict[int, tuple[bytes, Change]]]:
    """``changes`` with the live ones on the rows right after the base's, in log order, and the
    moved ones (by their index in ``changes``: their old tokens and the change)."""
    new_rows = _live_positions(changes, base_rows)
    moving = [
        (position, changes[position]) for position, row in new_rows.items() if changes[position].row != row
    ]
    renumbered = list(changes)
    moved: dict[int, tuple[bytes, Change]] = {}
    for start in range(0, len(moving), _TOKENIZE_BATCH):
        batch = moving[start : start + _TOKENIZE_BATCH]
        segments = []
        for position, change in batch:
            assert change.passage is not None
            segments.append(render_segment(new_rows[position], change.passage, template))
        for (position, change), tokens in zip(batch, tokenize_batch(segments), strict=True):
            new = Change(
                change.id,
                change.version,
                new_rows[position],
                change.passage,
                tuple(tokens),
                change.vector,
            )
            renumbered[position] = new
            moved[position] = (np.asarray(change.tokens, dtype=TOKEN_DTYPE).tobytes(), new)
    return renumbered, moved


def _live_positions(changes: Sequence[Change], base_rows: int) -> dict[int, int]:
    """The row each live change gets, by its index in ``changes``: the next after the base's."""
    positions: dict[int, int] = {}
    row = base_rows
    for position, change in enumerate(changes):
        if change.row is not None:
            positions[position] = row
            row += 1
    return positions


def _rewrite(
    log: sqlite3.Connection,
    log_path: Path,
    kept: list[tuple[int, Change]],
    moved: dict[int, tuple[bytes, Change]],
    identity: dict[str, str],
) -> None:
    """Drop every row but the kept ones, store the moved rows' new numbers and tokens, record the
    embedder; then truncate the WAL (and shrink the file if much of it is free)."""
    log.execute("BEGIN IMMEDIATE")
    try:
        cursor = log.execute(
            "DELETE FROM changes WHERE seq NOT IN (SELECT MAX(seq) FROM changes GROUP BY id)"
        )
        dropped = cursor.rowcount
        for position, (_, change) in moved.items():
            seq = kept[position][0]
            record = record_of(change)
            log.execute(
                "UPDATE changes SET row = ?, tokens = ?, checksum = ? WHERE seq = ?",
                (change.row, record[5], record[7], seq),
            )
        log.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", identity.items())
        log.execute("COMMIT")
    except BaseException:
        log.execute("ROLLBACK")
        raise
    if dropped or moved:
        (free,) = log.execute("PRAGMA freelist_count").fetchone()
        (pages,) = log.execute("PRAGMA page_count").fetchone()
        if free * 4 > pages:
            log.execute("VACUUM")
        truncate_wal(log, log_path)
        logger.info(
            "checkpointed the document log %s: %d superseded changes dropped, %d rows renumbered",
            log_path,
            dropped,
            len(moved),
        )
