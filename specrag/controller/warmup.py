"""System-prompt warm-up: shared work one query may trigger and every later query profits from.

The warm-up outlives the query that started it (it may still run when that query's answer is
done), so it is recorded here, in the controller's own :class:`WarmupRecord`, and never in a
query's timeline: the query notes only that it triggered one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass

from specrag.cache.tree import KnowledgeTree
from specrag.controller.gate import PrefillGate, Slot
from specrag.pipeline.engine import Engine
from specrag.pipeline.prompt import PromptBuilder

logger = logging.getLogger(__name__)


@dataclass
class WarmupRecord:
    """Warm-ups started, and how they ended (the last one's cached tokens: 0 when it was cold)."""

    started: int = 0
    succeeded: int = 0
    failed: int = 0
    last_cached_tokens: int | None = None


class SystemPromptWarmer:
    """Prefills the system prompt when the tree says it is cold: one at a time, in a free slot."""

    def __init__(self, engine: Engine, builder: PromptBuilder, tree: KnowledgeTree, gate: PrefillGate):
        self.record = WarmupRecord()
        self._engine = engine
        self._builder = builder
        self._tree = tree
        self._gate = gate
        self._task: asyncio.Task[None] | None = None

    def start_if_cold(self) -> bool:
        """Start a warm-up if the system prompt is cold, none runs and the pool has room."""
        if self._tree.system_prompt_resident() or self._task is not None:
            return False
        slot = self._gate.try_speculate()
        if slot is None:
            return False
        self.record.started += 1
        self._task = asyncio.create_task(self._warm(slot), name="system-prompt-warmup")
        return True

    async def _warm(self, slot: Slot) -> None:
        try:
            result = await self._engine.warm(self._builder.system_layout_tokens(), "warm-" + uuid.uuid4().hex)
            self._tree.record_served(self._builder.system_layout(), result.cached_tokens)
            self._tree.record_prefilled(self._builder.system_layout())
            self.record.succeeded += 1
            self.record.last_cached_tokens = result.cached_tokens
        except Exception as error:  # warm-up is an optimisation: a failure must not fail a query
            self.record.failed += 1
            logger.warning("system prompt warm-up failed: %s", error)
        finally:
            slot.release()
            self._task = None

    async def close(self) -> None:
        """Stop a warm-up in progress (service shutdown)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
