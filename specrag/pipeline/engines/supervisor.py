"""Keep an engine alive: detect a dead or hung engine, replace it, tell whoever mirrors its cache.

:class:`SupervisedEngine` is an :class:`~specrag.pipeline.engines.protocol.Engine` that delegates to the
engine it started. When a request fails with :class:`EngineError` (the engine died, errored or
produced no token in time), it probes the engine with a one-token request under a deadline; if
that fails too, it closes the engine (bounded in time) and starts a new one: a restart of the
in-process vLLM engine, or a reconnect to an HTTP engine. A start that fails leaves the engine
``down`` and is retried with exponential backoff capped at ``max_backoff_s`` (for ever by
default), so a separate engine server that comes back on the same address is picked up within
seconds of being ready. While there is no engine, requests fail at once with
:class:`EngineUnavailableError` (the service's 503) rather than hang: :meth:`wait_ready` stops
waiting as soon as a start has failed. ``on_restart`` callbacks run once the new engine is up
(its prefix cache is empty: the knowledge tree must forget what it believed resident).
:meth:`begin_shutdown` says the service is stopping: the engine's failures from then on are the
shutdown's doing, so they are neither probed nor repaired, and they answer 503. It offers itself
as the engine's :class:`~specrag.pipeline.engines.protocol.Supervision`, so the controller and the service
ask the engine for supervision instead of checking its class.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from specrag.errors import EngineError, EngineUnavailableError
from specrag.pipeline.engines.protocol import (
    Engine,
    EngineCounts,
    EngineLoad,
    EngineOutput,
    EngineState,
    Sampling,
    Supervision,
    SupervisionStatus,
    WarmResult,
    now,
)

__all__ = ["SupervisedEngine", "SupervisorPolicy"]

logger = logging.getLogger(__name__)
# A one-token prompt: the cheapest request that proves the engine still steps.
_PROBE_PROMPT = (1,)


@dataclass(frozen=True)
class SupervisorPolicy:
    """How hard to try: probe deadline, close deadline, restart attempts and backoff.

    ``max_attempts=None`` retries for ever; ``max_backoff_s`` bounds how long an engine that is
    back waits to be noticed.
    """

    probe_timeout_s: float = 10.0
    close_timeout_s: float = 15.0
    max_attempts: int | None = None
    backoff_s: float = 1.0
    max_backoff_s: float = 5.0


class SupervisedEngine(Engine):
    """An engine that replaces itself when it dies or hangs (see the module docstring)."""

    def __init__(
        self, start: Callable[[], Awaitable[Engine]], policy: SupervisorPolicy | None = None
    ) -> None:
        self._start = start
        self.policy = policy or SupervisorPolicy()
        self._engine: Engine | None = None
        self._recovery: asyncio.Task[None] | None = None
        # Set when a recovery ends or one of its starts fails: waiters have their answer then.
        self._settled = asyncio.Event()
        self._on_restart: list[Callable[[], Awaitable[None] | None]] = []
        self.state: EngineState = "starting"
        self.restarts = 0
        self.last_recovery_s: float | None = None
        self.last_error: str | None = None

    async def start(self) -> SupervisedEngine:
        self._engine = await self._start()
        self.state = "ready"
        return self

    def on_restart(self, callback: Callable[[], Awaitable[None] | None]) -> Callable[[], None]:
        """Run ``callback`` after every replacement (the new engine's cache is empty).

        Returns the function that unregisters it, for a follower (a controller and its KV mirror)
        that ends before the engine does.
        """
        self._on_restart.append(callback)
        return lambda: self._on_restart.remove(callback)

    @property
    def engine(self) -> Engine:
        """The engine in service; :class:`EngineError` while there is none."""
        if self.state == "stopping":
            raise EngineUnavailableError("the service is shutting down")
        if self._engine is None or self.state != "ready":
            detail = f" (last error: {self.last_error})" if self.last_error else ""
            raise EngineUnavailableError(f"the engine is {self.state}{detail}; retry shortly")
        return self._engine

    # The Engine protocol, delegated ------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self._any_engine().block_size

    @property
    def max_model_len(self) -> int:
        return self._any_engine().max_model_len

    @property
    def kv_capacity_tokens(self) -> int | None:
        return self._any_engine().kv_capacity_tokens

    @property
    def batched_token_budget(self) -> int | None:
        return self._any_engine().batched_token_budget

    @property
    def supports_document_kv(self) -> bool:
        return bool(getattr(self._any_engine(), "supports_document_kv", False))

    @property
    def honours_penalties(self) -> bool:
        return self._any_engine().honours_penalties

    @property
    def supervision(self) -> Supervision:
        return self

    def known_failure(self) -> str | None:
        return self._engine.known_failure() if self._engine is not None and self.state == "ready" else None

    def _any_engine(self) -> Engine:
        """Static facts (block size, lengths) survive a restart: read them even while recovering."""
        if self._engine is None:
            raise EngineUnavailableError("the engine has not started")
        return self._engine

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: Sampling
    ) -> AsyncIterator[EngineOutput]:
        engine = self.engine
        try:
            async for output in engine.generate(request_id, prompt_token_ids, sampling):
                yield output
        except EngineError as error:
            self._failed(engine, error)

    async def abort(self, request_id: str) -> None:
        if self._engine is not None and self.state in ("ready", "stopping"):
            with contextlib.suppress(EngineError):
                await self._engine.abort(request_id)

    async def warm(self, prompt_token_ids: Sequence[int], request_id: str) -> WarmResult:
        engine = self.engine
        try:
            return await engine.warm(prompt_token_ids, request_id)
        except EngineError as error:
            self._failed(engine, error)

    def load(self) -> EngineLoad:
        if self._engine is None or self.state != "ready":
            return EngineLoad(prefilling=0, decoding=0)
        return self._engine.load()

    async def counts(self) -> EngineCounts:
        return await self.engine.counts()

    async def reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    def begin_shutdown(self) -> None:
        """The service is stopping: admit nothing more, and take failures for the shutdown's doing."""
        self.state = "stopping"

    async def close(self) -> None:
        self.begin_shutdown()
        if self._recovery is not None:
            self._recovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recovery
        engine, self._engine = self._engine, None
        self.state = "failed"
        self.last_error = "closed"
        if engine is not None:
            await self._close_bounded(engine)

    # Recovery: the Supervision capability ---------------------------------------------------------

    def status(self) -> SupervisionStatus:
        return SupervisionStatus(self.state, self.restarts, self.last_recovery_s)

    def report_failure(self, reason: str) -> None:
        """A caller saw the engine fail (e.g. no first token in time): check the current engine."""
        if self._engine is not None and self.state == "ready":
            self.suspect(self._engine, reason)

    def _failed(self, engine: Engine, error: EngineError) -> NoReturn:
        """Re-raise a request's failure after suspecting its engine; 503 while shutting down."""
        if self.state == "stopping":
            raise EngineUnavailableError(f"the service is shutting down ({error})") from error
        self.suspect(engine, str(error))
        raise error

    def suspect(self, engine: Engine, reason: str) -> None:
        """A request on ``engine`` failed: check it, and replace it if it does not answer."""
        if engine is not self._engine or self._recovery is not None or self.state == "stopping":
            return
        self.last_error = reason
        self._settled.clear()
        self._recovery = asyncio.create_task(self._check_and_recover(engine), name="engine-recovery")

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait (bounded) for a recovery in progress; True when an engine is in service.

        Returns at once when the engine is down (a start attempt failed): the next attempt may be
        long in coming, and a caller should hear "unavailable" now rather than hang.
        """
        if self._recovery is not None and self.state != "down":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settled.wait(), timeout_s)
        return self.state == "ready"

    async def _probe(self, engine: Engine) -> bool:
        async def one_token() -> None:
            async for _ in engine.generate(
                f"probe-{id(engine)}-{now()}", _PROBE_PROMPT, Sampling(max_tokens=1)
            ):
                return

        try:
            await asyncio.wait_for(one_token(), self.policy.probe_timeout_s)
        except (EngineError, TimeoutError) as error:
            logger.warning("engine probe failed: %s", error or "timed out")
            return False
        return True

    async def _check_and_recover(self, engine: Engine) -> None:
        try:
            if await self._probe(engine):
                return  # one request failed, the engine is fine
            await self._recover(engine)
        finally:
            self._recovery = None
            self._settled.set()

    async def _recover(self, old: Engine) -> None:
        started = now()
        self.state = "recovering"
        logger.error("replacing the engine: %s", self.last_error)
        await self._close_bounded(old)
        delay = self.policy.backoff_s
        attempts = self.policy.max_attempts
        attempt = 0
        while attempts is None or attempt < attempts:
            attempt += 1
            try:
                self._engine = await self._start()
            except Exception as error:
                self.last_error = f"restart attempt {attempt} failed: {error}"
                # The first failure says the engine is down; the retries that follow say little more.
                logger.log(logging.ERROR if attempt == 1 else logging.INFO, "%s", self.last_error)
                self.state = "down"
                self._settled.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.policy.max_backoff_s)
                continue
            if self.state != "stopping":
                self.state = "ready"
            self.restarts += 1
            self.last_recovery_s = now() - started
            for callback in self._on_restart:
                result = callback()
                if result is not None:
                    await result
            logger.warning("engine replaced in %.1f s", self.last_recovery_s)
            return
        self.state = "failed"
        self._engine = None

    async def _close_bounded(self, engine: Engine) -> None:
        try:
            await asyncio.wait_for(engine.close(), self.policy.close_timeout_s)
        except Exception as error:  # a dead engine may fail to close: it is being replaced anyway
            logger.warning("closing the old engine failed: %s", error or "timed out")
