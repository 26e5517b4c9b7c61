"""Assemble the running service: supervised engine(s), KV mirrors, controller, HTTP application.

One place builds the whole stack so ``specrag serve``, ``specrag demo``, the benchmarks and the
tests run the same thing: :func:`open_service` for the service, or its parts (:func:`open_engine`,
:func:`prompt_builder`, :func:`open_controller`) for a caller that needs no HTTP application, its
own index, or a fresh controller per configuration over one engine (``bench.e2e``). The engine is
the in-process vLLM engine (KV-cache events on, so the knowledge tree mirrors the prefix cache
exactly) or, with ``engine_urls``, any OpenAI-compatible server (mirrored through the KV events it
publishes over TCP when ``engine_kv_events`` says where); either way it is supervised: a
dead or hung engine is replaced, and on every replacement the tree forgets what it believed
cached and the KV mirror resubscribes.

Several engines make a pool (:mod:`specrag.service.run.pools`); one engine is a pool of one, so
every service goes through :func:`~specrag.service.run.pools.open_pool` and one :class:`Service`
holds the result. What shapes a service is :class:`~specrag.service.run.options.ServiceOptions`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
from aiohttp import web

from specrag.controller.controller import HEALTH_PROBE_TIMEOUT_S, ControllerConfig, RagController
from specrag.controller.placement import Placement
from specrag.errors import InvalidInputError
from specrag.pipeline.engines.config import KVEventSource, parse_cpus
from specrag.pipeline.engines.protocol import Engine
from specrag.pipeline.engines.supervisor import SupervisedEngine
from specrag.pipeline.kv_mirror.mirror import KVMirror
from specrag.pipeline.models.directory import served_model_name
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.search.search_runner import SearchRunner
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.http.app import create_app
from specrag.service.http.metrics import ServiceMetrics
from specrag.service.http.mirror_report import MIRROR_HEALTH, MirrorCollector, mirror_health
from specrag.service.http.monitoring import INDEX_HEALTH, SEARCH_SHARDS, SearchShardsHealth
from specrag.service.run.assets import Assets, CheckingAssets
from specrag.service.run.heap import frozen_heap
from specrag.service.run.options import ServiceOptions, base_engine_config
from specrag.service.run.pinning import pin_threads
from specrag.service.run.pools import (
    PoolEngine,
    connector,
    open_local_engines,
    open_pool,
    open_ray_engines,
    open_remote_engines,
    starter,
)
from specrag.service.run.sharded_serving import searching_on_shards

__all__ = [
    "Service",
    "open_controller",
    "open_engine",
    "open_service",
    "prompt_builder",
    "searching_on",
    "serving_engines",
]


@dataclass
class Service:
    """The parts of a running service, one engine or several (a pool of one is a pool), for
    callers (tests, benchmarks) that look inside."""

    app: web.Application
    controller: RagController
    placement: Placement
    mirrors: list[KVMirror]

    def supervised_engine(self, number: int = 0) -> SupervisedEngine:
        """Replica ``number``'s engine, which a supervisor keeps alive (every engine but Ray's)."""
        engine = self.placement.replicas[number].engine
        if not isinstance(engine, SupervisedEngine):
            raise InvalidInputError(f"replica {number}'s engine has no supervisor")
        return engine

    def begin_shutdown(self) -> None:
        """From now on new queries get 503 and engine failures are the shutdown's, not faults for
        a supervisor to repair (Ray replicas have none; the health checks stop with the service)."""
        for replica in self.placement.replicas:
            if isinstance(replica.engine, SupervisedEngine):
                replica.engine.begin_shutdown()


def _engine_starter(
    model_dir: Path, options: ServiceOptions, run_dir: Path
) -> tuple[Callable[[], Awaitable[Engine]], KVEventSource | None]:
    if options.engine_urls:
        (url,) = options.engine_urls  # several make a pool: _engines
        remote_events = options.engine_kv_events[0] if options.engine_kv_events else None
        return connector(url), KVEventSource.remote(remote_events) if remote_events is not None else None
    config = base_engine_config(model_dir, options).with_kv_events(run_dir)
    pin_to = None if options.engine_cpus is None else parse_cpus(options.engine_cpus, "--engine-cpus")
    return starter(config, pin_to), config.kv_event_source()


@contextlib.asynccontextmanager
async def open_engine(
    model_dir: Path, options: ServiceOptions, run_dir: Path
) -> AsyncIterator[tuple[SupervisedEngine, KVEventSource | None]]:
    """The supervised engine and where its KV events are published (None: nowhere known).

    ``model_dir`` is the in-process engine's model; ``options.engine_cpus`` pins every thread of
    its processes (benchmarks keep it off the vector search's core). Stopped on exit.
    """
    start, kv_events = _engine_starter(model_dir, options, run_dir)
    engine = await SupervisedEngine(start, options.supervisor).start()
    try:
        yield engine, kv_events
    finally:
        await engine.close()


def prompt_builder(assets: Assets, engine: Engine) -> PromptBuilder:
    """Prompts from the assets' tokenizer and store, padded to the engine's KV block size."""
    return PromptBuilder(assets.tokenizer, assets.store, block_size=engine.block_size)


@contextlib.asynccontextmanager
async def open_controller(
    engine: Engine,
    kv_events: KVEventSource | None,
    index: VectorIndex,
    builder: PromptBuilder,
    config: ControllerConfig,
    *,
    empty_cache: bool = False,
) -> AsyncIterator[tuple[RagController, KVMirror | None]]:
    """A controller over one engine (a pool of one, :func:`open_pool`) and its KV mirror (None
    when ``kv_events`` says nowhere), for a caller that wants a fresh controller per configuration
    over one engine (``bench.e2e``). ``empty_cache`` starts from an empty prefix cache, as every
    configuration of an experiment does. On exit the controller's queries are aborted and the
    mirror stops.
    """
    members = [PoolEngine("0", engine, kv_events)]
    async with open_pool(members, builder.system_layout_tokens(), empty_cache=empty_cache) as pool:
        controller = RagController(pool.placement, index, builder, config)
        try:
            yield controller, pool.mirrors[0] if pool.mirrors else None
        finally:
            await controller.close()


@contextlib.contextmanager
def searching_on(index: VectorIndex, search_cpus: str | None) -> Iterator[None]:
    """This process and ``index``'s searches on ``search_cpus`` while the block runs (None: as is).

    Entered after the in-process engine started, so that its processes were not spawned here.
    On exit the index searches on its previous runner again.
    """
    if search_cpus is None:
        yield
        return
    cores = parse_cpus(search_cpus, "--search-cpus")
    process, allowed = psutil.Process(), os.sched_getaffinity(0)
    previous = index.runner
    runner = SearchRunner(cpus=cores)
    index.use_runner(runner)
    pin_threads(process, cores)
    try:
        yield
    finally:
        index.use_runner(previous)
        runner.shutdown()
        pin_threads(process, allowed)


@contextlib.asynccontextmanager
async def open_service(
    assets: Assets | CheckingAssets, options: ServiceOptions, run_dir: Path
) -> AsyncIterator[Service]:
    """Start the stack, yield it, and on exit abort queries in flight and stop the engines.

    One path for every service: the engines (one supervised engine, or a pool's, see
    :class:`ServiceOptions`) -> their replicas, each with its tree, KV mirror and restart hook
    (:func:`open_pool`) -> the placement -> the controller -> the application. ``run_dir`` holds
    in-process engines' KV-event sockets. Assets still being checked (:class:`CheckingAssets`)
    are waited for while the one engine of a service that is not pooled starts
    (:func:`_serving_while_checked`); a pool's engines start once they are checked.
    """
    if isinstance(assets, CheckingAssets):
        if not options.pooled:
            async with _serving_while_checked(assets, options, run_dir) as service:
                yield service
            return
        assets = await assets.checked
    with contextlib.ExitStack() as shards:
        # Before the engines: a shard count the index does not have fails in seconds, not minutes.
        shard_health = await asyncio.to_thread(
            shards.enter_context, searching_on_shards(assets.index, options)
        )
        async with (
            _engines(assets, options, run_dir) as engines,
            serving_engines(engines, assets, options, shard_health) as service,
        ):
            yield service


@contextlib.asynccontextmanager
async def _serving_while_checked(
    checking: CheckingAssets, options: ServiceOptions, run_dir: Path
) -> AsyncIterator[Service]:
    """:func:`open_service` with its one engine starting from the verified model directory while
    the other artefacts are checked: the engine's start is mostly its own processes' work.

    An artefact's error ends the start with that error, once the engine started for nothing is
    closed: vLLM's start cannot be cancelled midway without leaving its processes behind, so it
    is let finish first. The shard count is checked against the index once the index is loaded.
    """
    async with contextlib.AsyncExitStack() as stack:
        starting = asyncio.ensure_future(
            stack.enter_async_context(_one_engine(checking.model_dir, options, run_dir))
        )
        try:
            assets = await checking.checked
        except BaseException:
            await asyncio.wait([starting])  # started (the stack closes it) or failed
            if not starting.cancelled():
                starting.exception()  # the artefact's error is the one to tell
            raise
        engines = await starting
        with contextlib.ExitStack() as shards:
            shard_health = await asyncio.to_thread(
                shards.enter_context, searching_on_shards(assets.index, options)
            )
            async with serving_engines(engines, assets, options, shard_health) as service:
                yield service


@contextlib.asynccontextmanager
async def serving_engines(
    engines: Sequence[PoolEngine],
    assets: Assets,
    options: ServiceOptions,
    shard_health: SearchShardsHealth | None = None,
) -> AsyncIterator[Service]:
    """:func:`open_service` once the engines run and the index is ready to search; public for a
    benchmark that brings engines of its own (``bench.capacity.profile``: simulated ones, which
    the service never starts), so that it measures the stack the service runs. ``shard_health``:
    how the search shard actors stand, when the index searches through them
    (:func:`searching_on_shards`)."""
    with searching_on(assets.index, options.search_cpus):
        # Each tree predicts the system prompt as it starts every prompt: padded to the engines' blocks.
        builder = prompt_builder(assets, engines[0].engine)
        async with open_pool(engines, builder.system_layout_tokens(), options.router) as pool:
            controller = RagController(pool.placement, assets.index, builder, options.controller)
            try:
                if assets.corpus is not None:
                    assets.corpus.segment_token_limit = builder.document_token_limit(
                        engines[0].engine.max_model_len, options.controller.max_tokens_default
                    )
                app = _application(controller, options, assets, pool.mirrors, shard_health)
                with frozen_heap():  # started: full collections skip what the start made
                    yield Service(app, controller, pool.placement, pool.mirrors)
            finally:
                await controller.close()


def _application(
    controller: RagController,
    options: ServiceOptions,
    assets: Assets,
    mirrors: Sequence[KVMirror],
    shard_health: SearchShardsHealth | None,
) -> web.Application:
    """The HTTP application over ``controller``, its metrics watching the profile and the mirrors,
    with the document routes when the assets have a live corpus and the search shard actors'
    health when it has them; it answers with the assets' model's name, as ``/v1/models`` and
    every response name it."""
    metrics = ServiceMetrics()
    replicas = controller.placement.replicas
    metrics.watch_prefill_profile(lambda: all(replica.tree.profile.measured for replica in replicas))
    if mirrors:
        metrics.watch_kv_mirror(
            lambda: sum(mirror.faults().lost_batches for mirror in mirrors),
            lambda: sum(mirror.faults().callback_errors for mirror in mirrors),
        )
        metrics.registry.register(MirrorCollector(mirrors))
    app = create_app(
        controller,
        options.access,
        corpus=assets.corpus,
        documents_off=assets.documents_off,
        metrics=metrics,
        model_name=served_model_name(assets.model_dir),
    )
    if mirrors:
        app[MIRROR_HEALTH] = lambda: mirror_health(mirrors)
    if shard_health is not None:
        app[SEARCH_SHARDS] = shard_health
    if (opened := assets.opened) is not None:
        # The backend's probe may ask a server: off the loop, within the engines' probe bound.
        app[INDEX_HEALTH] = lambda: asyncio.to_thread(opened.health, HEALTH_PROBE_TIMEOUT_S)
    return app


def _engines(
    assets: Assets, options: ServiceOptions, run_dir: Path
) -> contextlib.AbstractAsyncContextManager[list[PoolEngine]]:
    """The service's engines, of the kind and number the options ask for (:class:`ServiceOptions`)."""
    if not options.pooled:
        return _one_engine(assets.model_dir, options, run_dir)
    if options.ray_address is not None:
        return open_ray_engines(base_engine_config(assets.model_dir, options), options)
    if options.engine_urls:
        return open_remote_engines(options)
    return open_local_engines(base_engine_config(assets.model_dir, options), options, run_dir)


@contextlib.asynccontextmanager
async def _one_engine(
    model_dir: Path, options: ServiceOptions, run_dir: Path
) -> AsyncIterator[list[PoolEngine]]:
    """The one supervised engine of a service that is not pooled, as a pool of one (replica "0")."""
    async with open_engine(model_dir, options, run_dir) as (engine, kv_events):
        yield [PoolEngine("0", engine, kv_events)]
