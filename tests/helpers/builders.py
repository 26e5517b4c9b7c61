"""Controllers and their parts built for a test: scripted searches, one engine or a pool,
conversations, and a clock the test moves."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from specrag.controller.controller import AnswerDone, ControllerConfig, RagController, RagRequest
from specrag.controller.placement import Placement, Router
from specrag.controller.replicas import Replica
from specrag.pipeline.engines.protocol import (
    Engine,
)
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.search.stages import Capabilities, StagePlan, StageResult
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assets import Assets
from specrag.sim.replicas import simulated_replica

# A question the default corpus answers, and two scripted top-4 lists sharing their first two passages.
QUESTION = "How does asyncio.run create and close the event loop?"
A = [10, 11, 12, 13]
B = [10, 11, 14, 15]


class ScriptedSearcher:
    """A staged searcher whose stages are given: to make speculation right or wrong on purpose."""

    kind = "scripted"
    owner: Any = None
    capabilities = Capabilities()

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
    # Its stages are the script's, whatever the plan: so is its stage count.
    return VectorIndex(
        searcher, assets.index.passage_ids, None, assets.index.embedder, default_stages=len(stages)
    )


def make_controller(
    engine: Engine, assets: Assets, index: VectorIndex | None = None, **config: Any
) -> RagController:
    builder = PromptBuilder(assets.tokenizer, assets.store, block_size=engine.block_size)
    placement = Placement.of_one(engine, builder.system_layout_tokens())
    return RagController(placement, index or assets.index, builder, ControllerConfig(**config))


def simulated_pool(assets: Assets, n: int, **engine_options: Any) -> list[Replica]:
    """``n`` simulated replicas, each with its own tree fed by its own KV events."""
    builder = PromptBuilder(assets.tokenizer, assets.store, block_size=32)
    options = {"time_scale": 0.01, "max_model_len": 4096, **engine_options}
    return [simulated_replica(f"r{i}", builder.system_layout_tokens(), **options) for i in range(n)]


def pool_controller(
    pool: Sequence[Replica],
    assets: Assets,
    index: VectorIndex,
    router: Router | str = Router.SPECRAG,
    **config: Any,
) -> RagController:
    """A controller over several replicas behind a router."""
    builder = PromptBuilder(assets.tokenizer, assets.store, block_size=pool[0].engine.block_size)
    return RagController(Placement(pool, router=router), index, builder, ControllerConfig(**config))


def count_question_tokenizations(controller: RagController) -> list[str]:
    """The questions the controller's prompt builder tokenizes, one entry per call."""
    seen: list[str] = []
    tokenize = controller.builder.question_tokens

    def counting(question: str) -> list[int]:
        seen.append(question)
        return tokenize(question)

    controller.builder.question_tokens = counting  # type: ignore[method-assign]
    return seen


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def questions(assets: Assets, count: int) -> list[str]:
    """Questions on different topics, so every turn retrieves new documents."""
    step = len(assets.passages) // count
    return [f"What does {assets.passages[i * step].title} say?" for i in range(count)]


async def run_conversation(
    controller: RagController, turns: int, assets: Assets, k: int | None = None
) -> list[AnswerDone]:
    """``turns`` turns (at the controller's defaults but for ``k``), checking after each that the
    model still sees every retrieved document: sent now, or given by a turn still in the context."""
    session_id = controller.create_session("test")
    answers = []
    for question in questions(assets, turns):
        done = await controller.answer(RagRequest(question, k=k, session_id=session_id, client="test"))
        session = controller.sessions.get(session_id, "test")
        assert session.history[: len(done.prompt.token_ids)] == done.prompt.token_ids
        store = controller.builder.store
        given = [store.passage(int(doc)).id for past in session.context for doc in past.documents]
        assert len(given) == len(set(given)) and set(done.timeline.documents) <= set(given)
        answers.append(done)
    return answers
