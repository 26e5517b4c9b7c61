"""One staged searcher over N shards, merging their running top-k stage by stage.

Every shard advances by the same units in each stage (IVF: the same slice of its probe list),
and the merged running top-k is the best ``k`` of the shards' running top-k, kept in faiss's
heaps (:class:`~specrag.retrieval.backends.local.topk.RunningTopK`, ties broken by id as a one-shot search
breaks them). IVF shards share one coarse quantizer, so each probes the same lists in the same
order as the unsharded index; the rows of a list are split among the shards, and the best ``k``
of the union of the shards' best ``k`` is the best ``k`` of the union: every stage, the last one
included, equals the unsharded index's. HNSW shards are separate graphs: their merge is exact
over what each graph found, and its recall against one graph is measured (bench.scale.shards).

A shard that fails (:class:`~specrag.errors.ShardUnavailableError`) fails the search, unless the
search was given a :class:`ShardAnswers` (a request's ``allow_partial``): then the shard leaves the
search, the merge goes on over the shards that answered, and the record names both.

The shards are anything with a cursor (:class:`Shard`): searchers in this process, or search
actors elsewhere (:mod:`specrag.retrieval.backends.shards.search_actors`), advanced side by side through
``fan_out``. The speculation policy, the stage plan and the timeline see one searcher.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from specrag.errors import InvalidInputError, ShardUnavailableError
from specrag.retrieval.backends.local.topk import RunningTopK
from specrag.retrieval.live_index import Visibility
from specrag.retrieval.search.stages import (
    Capabilities,
    StageCursor,
    StagePlan,
    StageResult,
    prepare_queries,
    run_stages,
)

__all__ = [
    "FanOut",
    "MergedCursor",
    "Shard",
    "ShardAnswers",
    "ShardedSearcher",
    "owner_shards",
    "shard_name",
    "split_rows",
]

_T = TypeVar("_T")


def split_rows(num_rows: int, shards: int) -> list[np.ndarray]:
    """The rows each shard owns: row ``r`` belongs to shard ``r % shards``, so shards stay the
    same size as documents are added, and a row's owner is known without a lookup."""
    if shards < 1:
        raise InvalidInputError(f"the shard count must be at least 1, got {shards}")
    if shards > num_rows:
        raise InvalidInputError(f"{shards} shards need at least as many rows, got {num_rows}")
    return [np.arange(number, num_rows, shards, dtype=np.int64) for number in range(shards)]


def shard_name(number: int) -> str:
    """How shard ``number`` is named in errors, actors and timelines."""
    return f"{number:03d}"


@dataclass
class ShardAnswers:
    """Which shards a search that accepts a partial top-k heard from: given to a search, it lets
    a shard that fails leave it (its reason kept) instead of failing the search."""

    answered: list[str] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)


def _attempt(call: Callable[[], _T]) -> tuple[_T | None, ShardUnavailableError | None]:
    """``call``'s result, or the shard's failure to hand back (a thread pool would raise only
    the first)."""
    try:
        return call(), None
    except ShardUnavailableError as error:
        return None, error


def _lose(live: list[int], number: int, error: ShardUnavailableError, answers: ShardAnswers | None) -> None:
    """Shard ``number`` failed: the search fails, or, accepting a partial top-k (``answers``),
    goes on over the shards ``live`` without it while any shard is left."""
    if answers is None or len(live) == 1:
        raise error
    live.remove(number)
    answers.missing[shard_name(number)] = str(error)


def owner_shards(rows: np.ndarray, shards: int) -> np.ndarray:
    """The shard that owns each of ``rows`` (as :func:`split_rows` assigns them)."""
    owners: np.ndarray = np.asarray(rows, dtype=np.int64) % shards
    return owners


class Shard(Protocol):
    """What a sharded index needs of each shard (a staged searcher holding some of the rows,
    under their global row numbers)."""

    kind: str

    @property
    def dim(self) -> int: ...

    @property
    def ntotal(self) -> int: ...

    @property
    def settings(self) -> dict[str, Any]: ...

    @property
    def expected_units(self) -> int: ...

    def cursor(self, queries: np.ndarray, k: int, visibility: Visibility | None = None) -> StageCursor: ...

    def search(
        self, queries: np.ndarray, k: int, visibility: Visibility | None = None
    ) -> tuple[np.ndarray, np.ndarray]: ...

    def add_rows(self, vectors: np.ndarray, rows: np.ndarray, next_row: int) -> None: ...

    def compacted(self, keep: np.ndarray) -> Any: ...

    def stored_vectors(self, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


class FanOut(Protocol):
    """Runs one call a shard and returns their results in order."""

    def __call__(self, calls: Sequence[Callable[[], _T]]) -> list[_T]: ...


def _merge(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], k: int, keep_max: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` (distances, ids) of the shards' results, sorted, as faiss sorts its own."""
    top = RunningTopK(len(parts[0][0]), k, keep_max)
    for distances, ids in parts:
        top.add(distances, ids)
    return top.sorted()


class MergedCursor:
    """The shards' cursors advanced in lock step; the snapshot is their merged running top-k.

    ``merge_s`` holds the time each snapshot spent merging (what sharding adds to a stage
    beyond the slowest shard). With ``answers`` a shard that fails leaves the search (recorded
    there) and the others go on; without, its failure is the search's.
    """

    def __init__(
        self,
        cursors: Sequence[StageCursor],
        k: int,
        keep_max: bool,
        fan_out: FanOut,
        answers: ShardAnswers | None = None,
    ) -> None:
        self._cursors = list(cursors)
        self._k = k
        self._keep_max = keep_max
        self._fan_out = fan_out
        self._done = [False] * len(self._cursors)
        self._live = list(range(len(self._cursors)))
        self._answers = answers
        self.merge_s: list[float] = []

    def advance(self, units: int) -> bool:
        """Advance every shard not yet done (an HNSW shard may converge before the others)."""
        going = [number for number in self._live if not self._done[number]]
        finished = self._fan_out(
            [
                functools.partial(_attempt, functools.partial(self._cursors[number].advance, units))
                for number in going
            ]
        )
        for number, (done, error) in zip(going, finished, strict=True):
            if error is not None:
                _lose(self._live, number, error, self._answers)
            else:
                self._done[number] = bool(done)
        if self._answers is not None:
            self._answers.answered = [shard_name(number) for number in self._live]
        return all(self._done[number] for number in self._live)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        parts = self._fan_out([self._cursors[number].snapshot for number in self._live])
        started = time.perf_counter()
        merged = _merge(parts, self._k, self._keep_max)
        self.merge_s.append(time.perf_counter() - started)
        return merged


class ShardedSearcher:
    """A staged searcher (and a growable one, when its shards are) over ``shards``.

    ``quantizer_sha256`` names the coarse quantizer every IVF shard shares (None for HNSW); the
    index directory records it and each shard is checked against it at load. ``fan_out`` (a
    thread pool) runs the shards' calls side by side; without one they run one after another in
    the calling thread, as in-process shards share its cores anyway.
    """

    owner: Any = None  # a sharded index is saved shard by shard (specrag.retrieval.backends.shards.store)
    # Its shards take rows; their centroids are one shared quantizer, re-trained by a rebuild only.
    capabilities = Capabilities(live_rows=True, partial_answers=True)

    def __init__(
        self,
        shards: Sequence[Shard],
        quantizer_sha256: str | None,
        keep_max: bool,
        next_row: int | None = None,
        fan_out: Executor | None = None,
    ) -> None:
        if not shards:
            raise InvalidInputError("a sharded index needs at least one shard")
        kinds = {shard.kind for shard in shards}
        dims = {shard.dim for shard in shards}
        if len(kinds) != 1 or len(dims) != 1:
            raise InvalidInputError(
                f"shards of one index differ: kinds {sorted(kinds)}, dimensions {sorted(dims)}"
            )
        self.shards = list(shards)
        self.kind: str = kinds.pop()
        self.quantizer_sha256 = quantizer_sha256
        self.keep_max = keep_max
        self._next_row = self.ntotal if next_row is None else next_row
        self._executor = fan_out

    @property
    def dim(self) -> int:
        return self.shards[0].dim

    @property
    def ntotal(self) -> int:
        return sum(shard.ntotal for shard in self.shards)

    @property
    def expected_units(self) -> int:
        """Units a whole search takes: the most any shard takes (each advances by the same)."""
        return max(shard.expected_units for shard in self.shards)

    @property
    def settings(self) -> dict[str, Any]:
        return {
            **self.shards[0].settings,
            "shards": len(self.shards),
            "quantizer_sha256": self.quantizer_sha256,
        }

    def fan_out(self, calls: Sequence[Callable[[], _T]]) -> list[_T]:
        """The results of ``calls`` (one a shard), side by side when there is a pool."""
        if self._executor is None or len(calls) == 1:
            return [call() for call in calls]
        futures = [self._executor.submit(call) for call in calls]
        return [future.result() for future in futures]

    def cursor(
        self,
        queries: np.ndarray,
        k: int,
        visibility: Visibility | None = None,
        answers: ShardAnswers | None = None,
    ) -> MergedCursor:
        """A merged search of ``queries`` to advance stage by stage (only rows ``visibility``
        shows); with ``answers``, over the shards that answer (:class:`MergedCursor`)."""
        matrix = prepare_queries(queries, self.dim, self.ntotal, k)
        cursors = self.fan_out(
            [functools.partial(shard.cursor, matrix, k, visibility) for shard in self.shards]
        )
        return MergedCursor(cursors, k, self.keep_max, self.fan_out, answers)

    def stages(
        self,
        queries: np.ndarray,
        k: int,
        plan: StagePlan,
        visibility: Visibility | None = None,
        answers: ShardAnswers | None = None,
    ) -> Iterator[StageResult]:
        """Every shard's stages in lock step; each stage yields the merged running top-k (of the
        shards that answered, given ``answers``)."""
        started = time.perf_counter()
        cursor = self.cursor(queries, k, visibility, answers)
        yield from run_stages(cursor.advance, cursor.snapshot, plan, self.expected_units, started=started)

    def search(
        self,
        queries: np.ndarray,
        k: int,
        visibility: Visibility | None = None,
        answers: ShardAnswers | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The merge of every shard's one-shot search: (distances, ids), shape (n, k); with
        ``answers``, of the shards that answered (as :meth:`cursor`)."""
        matrix = prepare_queries(queries, self.dim, self.ntotal, k)
        finished = self.fan_out(
            [
                functools.partial(_attempt, functools.partial(shard.search, matrix, k, visibility))
                for shard in self.shards
            ]
        )
        live = list(range(len(self.shards)))
        for number, (_, error) in enumerate(finished):
            if error is not None:
                _lose(live, number, error, answers)
        if answers is not None:
            answers.answered = [shard_name(number) for number in live]
        parts = [part for part, _ in finished if part is not None]
        return _merge(parts, k, self.keep_max)

    @property
    def next_row(self) -> int:
        """The row the next :meth:`add` must start at."""
        return self._next_row

    def add(self, vectors: np.ndarray, first_row: int) -> None:
        """Add ``vectors`` as rows ``first_row`` (:attr:`next_row`), ``first_row + 1``, ..., each
        to the shard that owns it (:func:`owner_shards`)."""
        matrix = np.ascontiguousarray(vectors, dtype=np.float32)
        if first_row != self._next_row:
            raise InvalidInputError(f"added rows must start at row {self._next_row}, got {first_row}")
        rows = np.arange(first_row, first_row + len(matrix), dtype=np.int64)
        owners = owner_shards(rows, len(self.shards))
        end = first_row + len(matrix)
        for number, shard in enumerate(self.shards):
            mine = owners == number
            if mine.any():
                shard.add_rows(matrix[mine], rows[mine], end)
        self._next_row = end

    def compacted(self, keep: np.ndarray) -> ShardedSearcher:
        """Every shard compacted (the same quantizer, the hidden rows gone)."""
        return ShardedSearcher(
            [shard.compacted(keep) for shard in self.shards],
            self.quantizer_sha256,
            self.keep_max,
            len(keep),
            self._executor,
        )

    def stored_vectors(self, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows kept and their vectors as stored, in row order."""
        parts = [shard.stored_vectors(keep) for shard in self.shards]
        rows = np.concatenate([found for found, _ in parts])
        vectors = np.concatenate([stored for _, stored in parts])
        order = np.argsort(rows, kind="stable")
        return rows[order], vectors[order]
