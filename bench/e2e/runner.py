"""Replay a trace through the controller on the real engine, one configuration at a time.

Every configuration starts from the same state: the engine's prefix cache emptied, a fresh
controller (so a fresh knowledge tree, mirrored through KV events when the engine publishes them,
assembled as the service assembles it) and the same trace replayed open-loop at its recorded
arrival times. That the cache really was empty is checked with the engine's own answer, not
assumed: after the reset (which the engine confirms or refuses), a probe of the system prompt,
which every earlier run served, must find nothing cached; then the cache is reset again.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from bench.e2e.workload import TraceQuery
from specrag.controller.controller import ControllerConfig, RagController, RagRequest
from specrag.controller.modes import ModeName
from specrag.pipeline.engines.config import KVEventSource
from specrag.pipeline.engines.protocol import Engine, Sampling, now
from specrag.pipeline.kv_mirror.mirror import MirrorFaults
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assembly import open_controller


@dataclass(frozen=True)
class Configuration:
    """One row of the comparison: a mode plus controller overrides and the searched fraction."""

    name: str
    mode: ModeName | str
    group: str
    search_ratio: float
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunResult:
    configuration: Configuration
    records: list[dict[str, Any]]
    wall_s: float
    nprobe: int
    prompts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    reset_confirmed: bool = False
    system_prompt_tokens: int = 0
    mirror: MirrorFaults | None = None  # None: the engine publishes no KV events


def set_search_ratio(index: VectorIndex, ratio: float) -> int:
    """Probe ``ratio`` of the IVF lists (RAGCache's "vector search ratio"); returns nprobe. The
    searcher is an IVF one: in-process (``StagedIVF``) or a pgvector table's IVFFlat."""
    searcher: Any = index.searcher
    nlist = int(searcher.nlist)
    searcher.nprobe = max(1, min(nlist, round(ratio * nlist)))
    return int(searcher.nprobe)


async def replay(
    controller: RagController, trace: Sequence[TraceQuery], k: int, max_tokens: int, mode: str
) -> tuple[list[dict[str, Any]], dict[int, tuple[int, ...]], float]:
    """Submit each query at its arrival time; turns of one conversation run in order."""
    sessions: dict[str, tuple[str, asyncio.Lock]] = {}
    records: list[dict[str, Any]] = [{} for _ in trace]
    prompts: dict[int, tuple[int, ...]] = {}
    started = now()

    async def one(i: int, query: TraceQuery) -> None:
        await asyncio.sleep(max(0.0, started + query.t - now()))
        lock: asyncio.Lock | contextlib.nullcontext[None] = contextlib.nullcontext()
        session_id = None
        if query.session is not None:
            if query.session not in sessions:
                sessions[query.session] = (controller.create_session(query.session), asyncio.Lock())
            session_id, lock = sessions[query.session]
        async with lock:
            request = RagRequest(
                query.query,
                k=k,
                mode=mode,
                max_tokens=max_tokens,
                session_id=session_id,
                client=query.session,
            )
            try:
                done = await controller.answer(request)
            except Exception as error:  # a failed request is a result too: counted, not fatal
                records[i] = {"i": i, "error": f"{type(error).__name__}: {error}"}
                return
        records[i] = {"i": i, "arrival_s": query.t, "session": query.session, **done.timeline.to_dict()}
        prompts[i] = done.prompt.token_ids

    await asyncio.gather(*(one(i, query) for i, query in enumerate(trace)))
    return records, prompts, now() - started


async def run_configuration(
    engine: Engine,
    kv_events: KVEventSource | None,
    index: VectorIndex,
    builder: PromptBuilder,
    base: ControllerConfig,
    configuration: Configuration,
    trace: Sequence[TraceQuery],
    k: int,
    max_tokens: int,
) -> RunResult:
    nprobe = set_search_ratio(index, configuration.search_ratio)
    config = replace(base, mode=configuration.mode, **configuration.overrides)
    confirmed = await reset_confirmed(engine, builder.system_layout_tokens())
    stack = open_controller(engine, kv_events, index, builder, config, empty_cache=True)
    async with stack as (controller, mirror):
        records, prompts, wall = await replay(controller, trace, k, max_tokens, configuration.mode)
        faults = mirror.faults() if mirror is not None else None
    system_tokens = len(builder.system_layout_tokens())
    return RunResult(configuration, records, wall, nprobe, prompts, confirmed, system_tokens, faults)


async def reset_confirmed(engine: Engine, served_prefix: Sequence[int]) -> bool:
    """Reset the prefix cache and check with the engine that ``served_prefix`` is no longer cached.

    The reset raises if the engine refuses it; the probe puts the prefix back, so the caller
    resets again (as :func:`~specrag.service.run.assembly.open_controller` does with ``empty_cache``).
    """
    await engine.reset_prefix_cache()
    probe = await engine.warm(served_prefix, "reset-probe-" + uuid.uuid4().hex)
    return probe.cached_tokens == 0


async def search_times_ms(index: VectorIndex, vectors: np.ndarray, k: int) -> list[float]:
    """Each one-shot search's time on the index's search runner (its pinned core), in ms."""
    timings = []
    for vector in vectors:
        started = now()
        async for _ in index.search_staged(vector, k, index.stage_plan(1)):
            pass
        timings.append((now() - started) * 1000)
    return timings


async def one_search_ms(index: VectorIndex, vectors: np.ndarray, k: int) -> float:
    """The median time of one-shot searches on the index's search runner."""
    return statistics.median(await search_times_ms(index, vectors, k))


async def ttft_of(engine: Engine, prompt: Sequence[int], started: float | None = None) -> float:
    """Time to first token of one prompt submitted alone, from ``started`` (default: the call)."""
    started = now() if started is None else started
    async for output in engine.generate("probe-" + uuid.uuid4().hex, prompt, Sampling(max_tokens=1)):
        return output.received_at - started
    raise RuntimeError("the engine produced no token")


async def oracle_ttfts(engine: Engine, prompts: dict[int, tuple[int, ...]]) -> dict[int, float]:
    """Each request's TTFT with its whole prompt cached and retrieval instant: the lower bound."""
    result = {}
    for i, prompt in sorted(prompts.items()):
        await ttft_of(engine, prompt)  # make it resident
        result[i] = await ttft_of(engine, prompt)
    return result
