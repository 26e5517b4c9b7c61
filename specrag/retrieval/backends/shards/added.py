"""The rows added to one shard since its files were written, kept by whoever stands for the shard.

A shard searched elsewhere (a Ray actor) loads its rows from its files, again after a restart: a
row added only to the running shard would be lost with it. So the controller keeps every row it
added to the shard (its vector and row number, in the order they were added) and sends a shard
that holds fewer rows than it should the ones it lacks
(:mod:`specrag.retrieval.backends.shards.search_actors`).
A shard holds its files' rows and then a prefix of these, so the count it holds says which; the
row numbers are the controller's, and each row is kept (and held by an actor) once, however often
its add is sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["AddedRows"]


@dataclass
class AddedRows:
    """Rows added to a shard whose files hold ``base`` rows and end before ``base_next_row``."""

    base: int
    base_next_row: int
    dim: int
    _vectors: list[np.ndarray] = field(default_factory=list)
    _rows: list[np.ndarray] = field(default_factory=list)
    _count: int = 0
    _next_row: int | None = None

    @property
    def ntotal(self) -> int:
        """The rows the shard should hold: its files' and the added ones."""
        return self.base + self._count

    @property
    def next_row(self) -> int:
        """The row the next add to the index starts at, as the last add to this shard said."""
        return self.base_next_row if self._next_row is None else self._next_row

    @property
    def last_row(self) -> int:
        """The highest row recorded (the files' rows all lie below ``base_next_row``)."""
        if not self._rows:
            return self.base_next_row - 1
        return int(self._rows[-1][-1]) if len(self._rows[-1]) else self.base_next_row - 1

    def record(self, vectors: np.ndarray, rows: np.ndarray, next_row: int) -> None:
        """Keep ``vectors`` as the shard's ``rows``, after every row recorded so far. Row numbers
        only grow, and an add whose answer was lost is sent again: rows recorded already are
        skipped, so each row is kept once."""
        numbers = np.asarray(rows, dtype=np.int64)
        fresh = numbers > self.last_row
        if fresh.any():
            self._vectors.append(np.ascontiguousarray(np.asarray(vectors)[fresh], dtype=np.float32))
            self._rows.append(numbers[fresh])
            self._count += int(fresh.sum())
        self._next_row = max(next_row, self.next_row)

    def held_before(self, row: int) -> int:
        """The rows the shard holds before row ``row``: its files' and the added rows below it."""
        return self.base + sum(int(np.count_nonzero(part < row)) for part in self._rows)

    def since(self, held: int) -> tuple[np.ndarray, np.ndarray]:
        """The (vectors, rows) a shard holding ``held`` rows lacks, in the order they were added."""
        skip = max(held - self.base, 0)
        if not self._rows:
            return np.zeros((0, self.dim), dtype=np.float32), np.zeros(0, dtype=np.int64)
        if len(self._rows) > 1:  # one array from now on: a catch-up is rare, an add is not
            self._vectors = [np.concatenate(self._vectors)]
            self._rows = [np.concatenate(self._rows)]
        return self._vectors[0][skip:], self._rows[0][skip:]
