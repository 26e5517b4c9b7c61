"""What the queries of one controller share: built by the controller for each new run, read by the
run and its speculation steps, never changed by them."""

from __future__ import annotations

from dataclasses import dataclass

from specrag.cache.hints import HintConfig
from specrag.cache.prefill_estimator import PrefillEstimator
from specrag.controller.config import ControllerConfig
from specrag.controller.conversation import TurnPrompts
from specrag.controller.gate import PrefillGate
from specrag.controller.placement import Placement
from specrag.controller.sessions import SessionStore
from specrag.controller.warmup import SystemPromptWarmer
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.vector_index import VectorIndex

__all__ = ["QueryShared"]


@dataclass(frozen=True)
class QueryShared:
    """What the queries of one controller share; a run reads it and never changes it."""

    config: ControllerConfig
    placement: Placement
    index: VectorIndex
    builder: PromptBuilder
    prefill_estimator: PrefillEstimator
    gate: PrefillGate
    sessions: SessionStore
    warmer: SystemPromptWarmer
    hints: HintConfig
    turn_prompts: TurnPrompts
