"""EngineBase: the validation, request tracking, abort-on-leave and closing every adapter inherits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

import pytest

from specrag.errors import EngineError, InvalidInputError
from specrag.pipeline.engines.base import EngineBase
from specrag.pipeline.engines.protocol import Engine, EngineCounts, EngineOutput, Sampling, now


class ScriptedEngine(EngineBase):
    """An adapter whose engine is the test: it feeds each request's outputs (or an error) by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self.resets = 0
        self.refusals = 0  # resets the engine refuses first (blocks in use)
        self.shut_downs = 0
        self._feeds: dict[str, asyncio.Queue[EngineOutput | Exception]] = {}

    @property
    def block_size(self) -> int:
        return 16

    @property
    def max_model_len(self) -> int:
        return 64

    @property
    def kv_capacity_tokens(self) -> int | None:
        return None

    def send(self, request_id: str, *, finished: bool = False, cached: int = 0) -> None:
        reason = "length" if finished else None
        output = EngineOutput(request_id, (7,), " t7", 3, cached, finished, reason, now())
        self._feeds[request_id].put_nowait(output)

    def fail(self, request_id: str, error: Exception) -> None:
        self._feeds[request_id].put_nowait(error)

    async def _stream(
        self, request_id: str, prompt: list[int], sampling: Sampling
    ) -> AsyncGenerator[EngineOutput, None]:
        self.submitted.append(request_id)
        feed = self._feeds.setdefault(request_id, asyncio.Queue())
        while True:
            item = await feed.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finished:
                return

    async def _abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def _counts(self) -> EngineCounts:
        return EngineCounts(running=0, waiting=0, unfinished=0)

    async def _reset_prefix_cache(self) -> bool:
        if self.refusals:
            self.refusals -= 1
            return False
        self.resets += 1
        return True

    async def _shut_down(self) -> None:
        self.shut_downs += 1


Started = tuple[AsyncIterator[EngineOutput], "asyncio.Future[EngineOutput]"]


async def _submitted(engine: ScriptedEngine, request_id: str) -> Started:
    """Start a request, wait until the base has handed it to the engine: (stream, its first output)."""
    stream = engine.generate(request_id, [1, 2, 3], Sampling(max_tokens=4))
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)  # one turn of the loop: the task runs until the engine waits
    assert request_id in engine.submitted
    return stream, first


def _load(engine: EngineBase) -> tuple[int, int]:
    load = engine.load()
    return load.prefilling, load.decoding


async def test_a_request_is_tracked_from_submission_through_its_first_token_to_its_end() -> None:
    engine = ScriptedEngine()
    assert isinstance(engine, Engine)
    stream, first = await _submitted(engine, "a")
    assert _load(engine) == (1, 0)
    engine.send("a")
    assert not (await first).finished
    assert _load(engine) == (0, 1)
    engine.send("a", finished=True)
    assert (await anext(stream)).finished
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert _load(engine) == (0, 0)
    assert engine.aborted == []  # it finished: nothing to abort


async def test_leaving_a_stream_early_aborts_the_request_in_the_engine() -> None:
    engine = ScriptedEngine()
    stream, first = await _submitted(engine, "left")
    engine.send("left")
    await first
    await stream.aclose()  # type: ignore[attr-defined]
    assert engine.aborted == ["left"] and _load(engine) == (0, 0)


async def test_cancelling_before_the_first_token_aborts_the_request() -> None:
    engine = ScriptedEngine()
    _, first = await _submitted(engine, "cancelled")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert engine.aborted == ["cancelled"] and _load(engine) == (0, 0)


async def test_an_engine_error_propagates_and_the_request_is_aborted() -> None:
    engine = ScriptedEngine()
    _, first = await _submitted(engine, "broken")
    engine.fail("broken", EngineError("core died"))
    with pytest.raises(EngineError, match="core died"):
        await first
    assert engine.aborted == ["broken"] and _load(engine) == (0, 0)


async def test_abort_untracks_at_once_and_reaches_the_engine() -> None:
    engine = ScriptedEngine()
    _, first = await _submitted(engine, "x")
    await engine.abort("x")
    assert engine.aborted == ["x"] and _load(engine) == (0, 0)
    await engine.abort("unknown")
    assert engine.aborted == ["x", "unknown"]
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_bad_requests_are_rejected_before_they_reach_the_engine() -> None:
    engine = ScriptedEngine()
    with pytest.raises(InvalidInputError, match="empty"):
        await anext(engine.generate("empty", [], Sampling()))
    with pytest.raises(InvalidInputError, match="exceeds the model's limit of 64"):
        await anext(engine.generate("long", [1] * 60, Sampling(max_tokens=5)))
    _, first = await _submitted(engine, "twice")
    with pytest.raises(InvalidInputError, match="already in flight"):
        await anext(engine.generate("twice", [1], Sampling()))
    assert engine.submitted == ["twice"] and _load(engine) == (1, 0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_warm_prefills_and_reports_the_engines_cache_hit() -> None:
    engine = ScriptedEngine()
    warming = asyncio.ensure_future(engine.warm([1] * 40, "warm"))
    await asyncio.sleep(0)
    engine.send("warm", finished=True, cached=32)
    result = await warming
    assert (result.prompt_tokens, result.cached_tokens, result.block_size) == (40, 32, 16)
    assert result.was_cached  # 2 full blocks, the last one always recomputed


async def test_a_refused_reset_is_retried_until_the_engine_does_it() -> None:
    engine = ScriptedEngine()
    engine.refusals = 3
    await engine.reset_prefix_cache()
    assert engine.resets == 1 and engine.refusals == 0


async def test_a_reset_the_engine_keeps_refusing_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("specrag.pipeline.engines.base.RESET_TIMEOUT_S", 0.2)
    engine = ScriptedEngine()
    engine.refusals = 10**6
    with pytest.raises(EngineError, match="refused to reset"):
        await engine.reset_prefix_cache()
    assert engine.resets == 0


async def test_an_abort_the_engine_fails_still_untracks_the_request() -> None:
    engine = ScriptedEngine()

    async def broken_abort(request_id: str) -> None:
        raise EngineError("the engine is gone")

    stream = engine.generate("doomed", [1, 2], Sampling())
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    engine._abort_request = broken_abort  # type: ignore[method-assign]
    with pytest.raises(EngineError, match="gone"):
        await engine.abort("doomed")
    assert engine.load().prefilling == 0
    pending.cancel()


async def test_a_closed_engine_shuts_down_once_and_refuses_everything() -> None:
    engine = ScriptedEngine()
    await engine.reset_prefix_cache()
    assert engine.resets == 1 and not engine.closed
    await engine.close()
    await engine.close()
    assert engine.shut_downs == 1 and engine.closed
    with pytest.raises(EngineError, match="closed"):
        await anext(engine.generate("late", [1], Sampling()))
    with pytest.raises(EngineError, match="closed"):
        await engine.counts()
    with pytest.raises(EngineError, match="closed"):
        await engine.reset_prefix_cache()
    with pytest.raises(EngineError, match="closed"):
        await engine.warm([1, 2], "late-warm")
    assert engine.submitted == [] and engine.resets == 1
