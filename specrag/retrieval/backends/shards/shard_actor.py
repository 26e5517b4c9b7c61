"""The search shard actor's own side: one shard, loaded from its directory, and its searches.

:mod:`specrag.retrieval.backends.shards.search_actors` starts these actors and stands for each in the
controller's process. The actor loads its shard on its first call, not in its constructor, so that
Ray reports it placed (``__ray_ready__``) as soon as its worker runs: a placement that cannot be
satisfied is then told apart from a shard that is slow to load. A restarted actor (Ray's
``max_restarts``) loads its files again on its first call.

A search call carries its caller's deadline: a call that waited in a queue past it (its caller
gave up: a stopped or restarting actor) is answered :class:`Expired` without running, beside the
caller's ``ray.cancel``, which reaches only the calls Ray has not handed to the actor yet.

Rows are the controller's: it numbers them, and an actor adds only rows it does not hold yet (at
or past its shard's ``next_row``), so an add sent twice (its first answer lost to a timeout) adds
nothing the second time.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from specrag.retrieval.backends.shards.store import load_shard
from specrag.retrieval.live_index import Visibility

__all__ = ["Behind", "Expired", "RowView", "SearchShard", "ShardInfo", "ShardState"]

# Searches a shard actor keeps in progress; the oldest is dropped past this (a search cancelled
# by its caller never says so), and is recomputed if it ever asks again.
_CURSORS_KEPT = 256


class ShardState(enum.StrEnum):
    """How a shard stands, as its last call or probe found it (``/health`` shows it)."""

    SERVING = "serving"  # its last call was answered
    UNRESPONSIVE = "unresponsive"  # its last call was not answered in time (busy, or Ray restarting it)
    REPLACING = "replacing"  # Ray gave up on its actor: a new one is starting
    LOST = "lost"  # its replacement did not start either (the next call tries again)


@dataclass(frozen=True)
class ShardInfo:
    """What a started shard actor reports about itself (``searches``: the search calls it has run
    since it started, abandoned ones that were cancelled before they ran not among them)."""

    kind: str
    dim: int
    ntotal: int
    expected_units: int
    settings: dict[str, Any]
    next_row: int
    pid: int
    searches: int = 0


@dataclass(frozen=True)
class Behind:
    """An actor's answer when it holds fewer rows than the call says it should (restarted from
    its files since rows were added): ``held``, the rows it holds."""

    held: int


@dataclass(frozen=True)
class Expired:
    """An actor's answer to a search whose caller stopped waiting before it ran (its deadline,
    this node's clock, had passed): nobody reads it, so the search is not run."""


@dataclass(frozen=True)
class RowView:
    """The rows a search may return, sent to a shard: the rows the snapshot knows and the hidden
    ones among them (few: replaced or deleted documents), not a flag for every row."""

    rows_known: int
    hidden: np.ndarray

    @classmethod
    def of(cls, visibility: Visibility | None) -> RowView | None:
        """``visibility`` as a view to send (None: every row is visible)."""
        if visibility is None or not visibility.hidden:
            return None
        return cls(len(visibility.visible), np.flatnonzero(~visibility.visible))

    @property
    def key(self) -> str:
        return f"{self.rows_known}:{hashlib.sha256(self.hidden.tobytes()).hexdigest()}"

    def visibility(self) -> Visibility:
        mapping = np.concatenate([np.arange(self.rows_known, dtype=np.int64), [-1]])
        mapping[self.hidden] = -1
        return Visibility(mapping, len(self.hidden))


class SearchShard:
    """The actor's body: one shard, loaded from its directory on first use, and the searches in progress."""

    def __init__(
        self, directory: str, number: int, count: int, quantizer_sha256: str | None, mmap: bool
    ) -> None:
        # One faiss thread: a single query's slice gains nothing from more, and their OpenMP
        # threads spin while they wait for each other on a node that is busy.
        faiss.omp_set_num_threads(1)
        self._load = functools.partial(load_shard, Path(directory), number, count, quantizer_sha256)
        self._mapped = mmap
        self._loaded: Any = None
        self._cursors: OrderedDict[str, tuple[Any, int, bool]] = OrderedDict()
        self._view: tuple[str, Visibility] | None = None
        self._searches = 0

    @property
    def _shard(self) -> Any:
        if self._loaded is None:
            self._loaded = self._load(mmap=self._mapped)
        return self._loaded

    def info(self) -> ShardInfo:
        shard = self._shard
        return ShardInfo(
            shard.kind,
            shard.dim,
            shard.ntotal,
            shard.expected_units,
            shard.settings,
            shard.next_row,
            os.getpid(),
            self._searches,
        )

    def _visibility(self, view: RowView | None) -> Visibility | None:
        if view is None:
            return None
        if self._view is None or self._view[0] != view.key:
            self._view = (view.key, view.visibility())
        return self._view[1]

    def add_rows(self, vectors: np.ndarray, rows: np.ndarray, next_row: int, held: int) -> int:
        """Add ``rows`` (their ``vectors``), which follow the shard's first ``held`` rows; the
        rows it holds then. Rows it holds already (numbered below its ``next_row``: a call sent
        again) are skipped; holding fewer than ``held`` (restarted since), it adds nothing and
        the caller sends what it lacks."""
        have = self._shard.ntotal
        if have < held:
            return int(have)
        fresh = np.asarray(rows) >= self._shard.next_row
        if fresh.any():
            if self._mapped:  # mapped lists are read-only: read them into memory once
                self._loaded = self._load(mmap=False)
                self._mapped = False
            self._shard.add_rows(vectors[fresh], rows[fresh], next_row)
        return int(self._shard.ntotal)

    def advance_to(
        self,
        search_id: str,
        target: int,
        queries: np.ndarray,
        k: int,
        view: RowView | None,
        held: int,
        deadline: float,
    ) -> tuple[bool, np.ndarray, np.ndarray] | Behind | Expired:
        """Advance search ``search_id`` until it has done ``target`` units (starting it, from
        the query and the view, when this actor does not hold it); its running top-k, or
        :class:`Behind` while the shard holds fewer than ``held`` rows, or :class:`Expired`
        past ``deadline`` (``time.time()``)."""
        if time.time() > deadline:
            self._cursors.pop(search_id, None)
            return Expired()
        if self._shard.ntotal < held:
            return Behind(int(self._shard.ntotal))
        self._searches += 1
        entry = self._cursors.pop(search_id, None)
        if entry is None:
            entry = (self._shard.cursor(queries, k, self._visibility(view)), 0, False)
        cursor, units, done = entry
        if units < target and not done:
            done = cursor.advance(target - units)
            units = target
        distances, ids = cursor.snapshot()
        if not done:
            self._cursors[search_id] = (cursor, units, done)
            while len(self._cursors) > _CURSORS_KEPT:
                self._cursors.popitem(last=False)
        return done, distances, ids

    def search(
        self, queries: np.ndarray, k: int, view: RowView | None, held: int, deadline: float
    ) -> tuple[np.ndarray, np.ndarray] | Behind | Expired:
        if time.time() > deadline:
            return Expired()
        if self._shard.ntotal < held:
            return Behind(int(self._shard.ntotal))
        self._searches += 1
        result: tuple[np.ndarray, np.ndarray] = self._shard.search(queries, k, self._visibility(view))
        return result
