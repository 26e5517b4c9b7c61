"""Engine pools: several engines behind one router, each mirrored by its own knowledge tree.

A pool is N in-process vLLM engines (each pinned to its own core, each publishing its own KV
events), N separate engine servers (one URL each), or N vLLM replicas as Ray actors
(:mod:`specrag.pipeline.engines.ray_engine`). One engine is a pool of one: whatever their kind and
number, :func:`open_pool` gives each engine its replica (its own tree fed by its own KV events,
its restart hook) and puts them behind the router of :mod:`specrag.controller.placement`, whose
health checks bring an excluded engine back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from specrag.cache.tree import KnowledgeTree
from specrag.controller.placement import Placement, Router, health_checks
from specrag.controller.replicas import Replica
from specrag.errors import EngineError
from specrag.pipeline.engines.config import EngineConfig, KVEventSource
from specrag.pipeline.engines.protocol import Engine
from specrag.pipeline.engines.supervisor import SupervisedEngine
from specrag.pipeline.kv_mirror.mirror import KVMirror
from specrag.service.run.options import ServiceOptions
from specrag.service.run.pinning import descendant_pids, pin_engine_processes

__all__ = [
    "Pool",
    "PoolEngine",
    "connector",
    "follow_restarts",
    "free_port_pair",
    "open_local_engines",
    "open_pool",
    "open_ray_engines",
    "open_remote_engines",
    "starter",
]


def connector(url: str) -> Callable[[], Awaitable[Engine]]:
    """Connects to the engine server at ``url`` (again on every supervisor restart)."""
    from specrag.pipeline.engines.http_engine import HttpEngine

    async def connect() -> Engine:
        return await HttpEngine.connect(url)

    return connect


def starter(config: EngineConfig, pin_to: frozenset[int] | None = None) -> Callable[[], Awaitable[Engine]]:
    """Starts an in-process vLLM engine with ``config`` (again on every supervisor restart).

    With ``pin_to``, every thread of the engine's processes is pinned there once it runs (see
    specrag.service.run.pinning: vLLM's own binding reaches only the model worker's compute threads).
    """
    from specrag.pipeline.engines.vllm_engine import VllmEngine

    async def start() -> Engine:
        if pin_to is None:
            return await VllmEngine.start(config)
        others = descendant_pids()  # another engine of this process (a test's, a benchmark's) stays put
        engine = await VllmEngine.start(config)
        pin_engine_processes(pin_to, besides=others)
        return engine

    return start


def follow_restarts(
    engine: Engine, tree: KnowledgeTree, mirror: KVMirror | None
) -> Callable[[], None] | None:
    """When a supervised engine is replaced, its tree forgets the cache and its mirror resubscribes
    (the new engine's cache is empty, and it numbers its event batches from zero again).

    Returns the function that stops following; None for an engine that is never replaced.
    """
    if not isinstance(engine, SupervisedEngine):
        return None

    async def after_restart() -> None:
        tree.engine_cache_cleared()
        if mirror is not None:
            await mirror.restart()

    return engine.on_restart(after_restart)


@dataclass(frozen=True)
class PoolEngine:
    """One engine of a pool: its name, the engine, and where it publishes its KV events (None:
    nowhere known; its tree then keeps its capacity model)."""

    name: str
    engine: Engine
    kv_events: KVEventSource | None


@dataclass
class Pool:
    """The placement over a pool's engines and the KV mirror feeding each one's tree."""

    placement: Placement
    mirrors: list[KVMirror]


@contextlib.asynccontextmanager
async def open_pool(
    engines: Sequence[PoolEngine],
    system_token_ids: Sequence[int],
    router: Router | str = Router.SPECRAG,
    *,
    empty_cache: bool = False,
) -> AsyncIterator[Pool]:
    """The placement over ``engines``, whatever their kind and number: each gets its own tree, fed
    by its own KV events; health checks run while the block does (with several). The mirrors stop
    on exit, the engines not. ``empty_cache`` empties each engine's prefix cache first (its mirror
    then skips the engine's event history).

    A mirror resubscribes whenever its engine comes back: when the placement lets an excluded
    engine rejoin, and when a supervisor replaces it (whose tree then forgets the cache).
    """
    mirrors: list[KVMirror] = []
    forget: list[Callable[[], None]] = []
    try:
        replicas = []
        for member in engines:
            replica = Replica.for_engine(member.name, member.engine, system_token_ids)
            if empty_cache:
                await member.engine.reset_prefix_cache()
                replica.tree.engine_cache_cleared()
            mirror = (
                KVMirror(
                    replica.tree,
                    member.kv_events,
                    name=member.name,
                    reset_engine=member.engine.reset_prefix_cache,
                )
                if member.kv_events is not None
                else None
            )
            if mirror is not None:
                mirrors.append(mirror)
                await mirror.start(catch_up=not empty_cache)
                replica.rejoin_hooks.append(mirror.restart)
            stop_following = follow_restarts(member.engine, replica.tree, mirror)
            if stop_following is not None:
                forget.append(stop_following)
            replicas.append(replica)
        placement = Placement(replicas, router=router)
        async with health_checks(placement):
            yield Pool(placement, mirrors)
    finally:
        for stop_following in forget:
            stop_following()
        for mirror in mirrors:
            await mirror.stop()


EngineT = TypeVar("EngineT", bound=Engine)


@contextlib.asynccontextmanager
async def _started(
    starts: Sequence[Callable[[], Awaitable[EngineT]]], *, together: bool
) -> AsyncIterator[list[EngineT]]:
    """Every engine started (all at once, or one after the other); all closed on exit, and
    those that did start are closed when another does not."""
    engines: list[EngineT] = []
    try:
        if together:
            outcomes = await asyncio.gather(*(start() for start in starts), return_exceptions=True)
            engines += [outcome for outcome in outcomes if not isinstance(outcome, BaseException)]
            failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
            if failures:
                raise EngineError(
                    f"{len(failures)} of {len(starts)} engines did not start: {failures[0]}"
                ) from failures[0]
        else:
            for start in starts:
                engines.append(await start())
        yield engines
    finally:
        for engine in engines:
            await engine.close()


@contextlib.asynccontextmanager
async def open_local_engines(
    base: EngineConfig, options: ServiceOptions, run_dir: Path
) -> AsyncIterator[list[PoolEngine]]:
    """``options.replicas`` supervised in-process vLLM engines of ``base``; stopped on exit.

    Each engine's model worker is pinned to its own core (round robin over the cores this process
    may use), and each publishes its KV events on its own sockets in ``run_dir``. They start one
    after the other: each is about a minute of both cores' work on a small machine, and a start
    counts against its own timeout.
    """
    cores = sorted(os.sched_getaffinity(0))
    configs = [
        base.pinned_to(cores[number % len(cores)]).with_kv_events(
            run_dir / f"r{number}", topic=f"kv-{number}"
        )
        for number in range(options.replicas)
    ]
    starts = [_supervised(starter(config), options) for config in configs]
    async with _started(starts, together=False) as engines:
        yield [
            PoolEngine(f"r{number}", engine, config.kv_event_source())
            for number, (engine, config) in enumerate(zip(engines, configs, strict=True))
        ]


@contextlib.asynccontextmanager
async def open_remote_engines(options: ServiceOptions) -> AsyncIterator[list[PoolEngine]]:
    """A supervised engine per ``options.engine_urls`` server, each mirrored through the KV events
    its ``engine_kv_events`` endpoint publishes (when given); disconnected on exit."""
    sources: list[KVEventSource | None] = [
        KVEventSource.remote(endpoint) for endpoint in options.engine_kv_events
    ]
    sources = sources or [None] * len(options.engine_urls)
    starts = [_supervised(connector(url), options) for url in options.engine_urls]
    async with _started(starts, together=True) as engines:
        yield [
            PoolEngine(f"r{number}", engine, source)
            for number, (engine, source) in enumerate(zip(engines, sources, strict=True))
        ]


def _supervised(
    start: Callable[[], Awaitable[Engine]], options: ServiceOptions
) -> Callable[[], Awaitable[SupervisedEngine]]:
    """Starts ``start``'s engine under a supervisor, which starts it again whenever it is replaced."""

    async def supervised() -> SupervisedEngine:
        return await SupervisedEngine(start, options.supervisor).start()

    return supervised


@contextlib.asynccontextmanager
async def open_ray_engines(base: EngineConfig, options: ServiceOptions) -> AsyncIterator[list[PoolEngine]]:
    """``options.replicas`` vLLM replicas of ``base`` as Ray actors; all stopped on exit.

    Connects to the cluster at ``options.ray_address`` (or starts a local instance, shut down
    on exit). Each replica publishes its KV events on a port chosen free on this machine, bound
    on every interface of its node: the subscriber connects to the actor's node.
    """
    import ray

    from specrag.pipeline.engines.ray_engine import RayEngine, replica_config, subscriber_config

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=options.ray_address or None, include_dashboard=False, log_to_driver=False)
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        configs = [replica_config(base, i, free_port_pair(), cpus) for i in range(options.replicas)]

        def start(number: int) -> Callable[[], Awaitable[RayEngine]]:
            return lambda: RayEngine.start(configs[number], f"r{number}")

        async with _started([start(i) for i in range(len(configs))], together=True) as engines:
            yield [
                PoolEngine(engine.name, engine, subscriber_config(config, engine.node_ip))
                for engine, config in zip(engines, configs, strict=True)
            ]
    finally:
        if started_ray:
            ray.shutdown()


def free_port_pair() -> int:
    """A port P with P and P+1 free on this machine (KV events and their replay socket)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("0.0.0.0", 0))
            port = int(probe.getsockname()[1])
        with socket.socket() as second, contextlib.suppress(OSError):
            second.bind(("0.0.0.0", port + 1))
            return port
