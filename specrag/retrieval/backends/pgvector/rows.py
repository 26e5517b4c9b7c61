"""The service's names for a table's rows: row ``i`` is one (id, version) of the table.

A version the documents API (or another writer, through the listener) writes gets a row of its
own (:meth:`RowNames.map_rows`), so a search whose snapshot still holds the version before finds
the row that names it. A record a search reads is shown as the row of its version, or, when the
search's visibility does not show that version yet, as the row of the version it does show
(:meth:`RowNames.shown_row`): a document changed while a search begins is found in one version,
never in none. A record whose id has no version shown (another writer's new row, not yet shown)
stands for no row: the search skips it, and reads past it for its top-k.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from specrag.errors import InvalidInputError

__all__ = ["RowNames"]


def _visible(row: int, shown: np.ndarray) -> bool:
    """Whether ``shown`` (a visibility's row-to-passage map, padding last) shows ``row``."""
    return row < len(shown) - 1 and bool(shown[row] >= 0)


class RowNames:
    """Which row each (id, version) of the table is, and each id's rows, oldest first."""

    def __init__(self, row_ids: Sequence[str], versions: Sequence[int] | None = None) -> None:
        held = [1] * len(row_ids) if versions is None else list(versions)
        if len(held) != len(row_ids):
            raise InvalidInputError(f"{len(row_ids)} row ids and {len(held)} versions")
        self._row_of = {key: row for row, key in enumerate(zip(row_ids, held, strict=True))}
        # Each id's rows, oldest first (a tuple replaced whole: searches read it while rows are mapped).
        self._rows_of_id: dict[str, tuple[int, ...]] = {}
        for row, row_id in enumerate(row_ids):
            self._rows_of_id[row_id] = (*self._rows_of_id.get(row_id, ()), row)
        self.count = len(row_ids)

    def keys(self) -> list[tuple[str, int]]:
        """Each row's (id, version), in row order; a row whose key was re-mapped names its last."""
        keys: list[tuple[str, int] | None] = [None] * self.count
        for key, row in self._row_of.items():
            keys[row] = key
        return [key for key in keys if key is not None]

    def map_rows(self, keys: Sequence[tuple[str, int]], first_row: int) -> None:
        """Name rows ``first_row``, ``first_row + 1``, ... by the table's (id, version) ``keys``;
        the rows of the versions before stay named, for searches whose snapshot still holds them."""
        if first_row != self.count:
            raise InvalidInputError(f"rows are mapped from row {self.count}, not {first_row}")
        for offset, key in enumerate(keys):
            row_id = str(key[0])
            self._row_of[(row_id, int(key[1]))] = first_row + offset
            self._rows_of_id[row_id] = (*self._rows_of_id.get(row_id, ()), first_row + offset)
        self.count = first_row + len(keys)

    def shown_row(self, row_id: str, version: int, shown: np.ndarray | None) -> int | None:
        """The row a search shows for the table's (id, version) in its snapshot: that version's
        row, or, where the search's visibility does not show it, the row of the version the
        visibility shows; None when no version is shown."""
        row = self._row_of.get((row_id, version))
        if shown is None or (row is not None and _visible(row, shown)):
            return row
        return next(
            (held for held in reversed(self._rows_of_id.get(row_id, ())) if _visible(held, shown)), None
        )

    def shown_records(
        self, records: Sequence[tuple[Any, ...]], shown: np.ndarray | None
    ) -> Iterator[tuple[int, list[Any]]]:
        """The rows a search shows for records of (id, version, ...), best first, with the rest
        of each record; a record no shown version stands for, and a second record for a row
        already given (a version and its stand-in), are skipped."""
        taken: set[int] = set()
        for row_id, version, *rest in records:
            row = self.shown_row(row_id, int(version), shown)
            if row is None or row in taken:
                continue
            taken.add(row)
            yield row, rest
