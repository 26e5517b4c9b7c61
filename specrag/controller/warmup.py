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
from collections.abc import Sequence
from dataclasses import dataclass

from specrag.controller.gate import PrefillGate, Slot
from specrag.controller.replicas import Replica
from specrag.pipeline.store.prompt import PromptBuilder

__all__ = ["SystemPromptWarmer", "WarmupRecord"]

logger = logging.getLogger(__name__)


@dataclass
class WarmupRecord:
    """Warm-ups started, and how they ended (the last one's cached tokens: 0 when it was cold)."""

    started: int = 0
    succeeded: int = 0
    failed: int = 0
    last_cached_tokens: int | None = None


class SystemPromptWarmer:
    """Prefills the system prompt on each replica whose tree says it is cold: one at a time per
    replica, each in a free slot of the prefill pool.

    A warm-up is one token's request, so it gets the answers' first-token deadline
    (``timeout_s``): on an engine that hangs it would otherwise hold its slot of the pool, and
    keep its replica marked as warming, for as long as the engine does.
    """

    def __init__(
        self, replicas: Sequence[Replica], builder: PromptBuilder, gate: PrefillGate, timeout_s: float
    ):
        self.record = WarmupRecord()
        self._timeout_s = timeout_s
        self._replicas = tuple(replicas)
        self._builder = builder
        self._gate = gate
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def needed(self) -> bool:
        """Whether some available replica's system prompt is cold with no warm-up running there."""
        return any(self._cold(replica) for replica in self._replicas)

    def _cold(self, replica: Replica) -> bool:
        return (
            replica.available
            and not replica.tree.system_prompt_resident()
            and replica.name not in self._tasks
        )

    def start_if_cold(self) -> bool:
        """Start a warm-up on every available replica where the system prompt is cold, none runs
        and the pool has room; True if any started."""
        started = False
        for replica in self._replicas:
            if not self._cold(replica):
                continue
            slot = self._gate.try_speculate()
            if slot is None:
                break
            self.record.started += 1
            self._tasks[replica.name] = asyncio.create_task(
                self._warm(replica, slot), name=f"system-prompt-warmup-{replica.name}"
            )
            started = True
        return started

    async def _warm(self, replica: Replica, slot: Slot) -> None:
        try:
            prompt = self._builder.system_layout_tokens()
            async with asyncio.timeout(self._timeout_s):  # its request aborted if it passes
                result = await replica.engine.warm(prompt, "warm-" + uuid.uuid4().hex)
            replica.tree.record_served(self._builder.system_layout(), result.cached_tokens)
            replica.tree.record_prefilled(self._builder.system_layout())
            self.record.succeeded += 1
            self.record.last_cached_tokens = result.cached_tokens
        except TimeoutError:
            self.record.failed += 1
            logger.warning(
                "system prompt warm-up on %s: no token within %.1f s", replica.name, self._timeout_s
            )
        except Exception as error:  # warm-up is an optimisation: a failure must not fail a query
            self.record.failed += 1
            logger.warning("system prompt warm-up failed: %s", error)
        finally:
            slot.release()
            self._tasks.pop(replica.name, None)

    async def close(self) -> None:
        """Stop the warm-ups in progress (service shutdown)."""
        for task in list(self._tasks.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
