"""Controller fixtures: a controller on the real engine and a scripted staged index."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from specrag.controller.controller import ControllerConfig, RagController
from specrag.pipeline.engine import Engine
from specrag.pipeline.prompt import PromptBuilder
from specrag.retrieval.stages import StagePlan, StageResult
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.assets import Assets


class ScriptedSearcher:
    """A staged searcher whose stages are given: to make speculation right or wrong on purpose."""

    kind = "scripted"
    owner: Any = None

    def __init__(self, stages: Sequence[Sequence[int]], ntotal: int, dim: int, stage_delay_s: float) -> None:
        self._stages = [list(ids) for ids in stages]
        self._ntotal = ntotal
        self._dim = dim
        self._delay = stage_delay_s

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def ntotal(self) -> int:
        return self._ntotal

    @property
    def settings(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.array([self._stages[-1][:k]] * len(queries), dtype=np.int64)
        return np.zeros(ids.shape, dtype=np.float32), ids

    def stages(self, queries: np.ndarray, k: int, plan: StagePlan) -> Iterator[StageResult]:
        for number, ids in enumerate(self._stages, start=1):
            time.sleep(self._delay)  # the search's own time, in the search thread
            row = np.array([ids[:k]] * len(queries), dtype=np.int64)
            yield StageResult(
                number, row, np.zeros(row.shape, dtype=np.float32), number == len(self._stages), self._delay
            )


def scripted_index(
    assets: Assets, stages: Sequence[Sequence[int]], stage_delay_s: float = 0.3
) -> VectorIndex:
    searcher = ScriptedSearcher(stages, len(assets.passages), assets.index.dim, stage_delay_s)
    return VectorIndex(searcher, assets.index.passage_ids, None, assets.index.embedder)


def make_controller(
    engine: Engine, assets: Assets, index: VectorIndex | None = None, **config: Any
) -> RagController:
    builder = PromptBuilder(assets.tokenizer, assets.store, block_size=engine.block_size)
    return RagController(engine, index or assets.index, builder, ControllerConfig(**config))
