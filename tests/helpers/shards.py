"""A shard that never answers: what a dead shard actor's caller sees once its wait is over."""

from __future__ import annotations

from typing import Any

import numpy as np

from specrag.errors import ShardUnavailableError
from specrag.retrieval.live_index import Visibility
from specrag.retrieval.search.stages import StageCursor

__all__ = ["SilentShard"]


def _silent() -> ShardUnavailableError:
    return ShardUnavailableError("search shard 001 did not answer within 0s")


class _SilentCursor:
    def advance(self, units: int) -> bool:
        raise _silent()

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        raise AssertionError("a shard that never answered is not merged")


class SilentShard:
    """A real shard (shard 001 of its index) whose searches, staged or one-shot, never answer."""

    def __init__(self, shard: Any) -> None:
        self._shard = shard

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shard, name)

    def cursor(self, queries: np.ndarray, k: int, visibility: Visibility | None = None) -> StageCursor:
        return _SilentCursor()

    def search(
        self, queries: np.ndarray, k: int, visibility: Visibility | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        raise _silent()
