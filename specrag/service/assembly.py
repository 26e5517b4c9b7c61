"""Assemble the running service: supervised engine, KV mirror, controller, HTTP application.

One place builds the whole stack so ``specrag serve``, ``specrag demo``, the benchmarks and the
tests run the same thing: :func:`open_service` for the service, or its parts (:func:`open_engine`,
:func:`prompt_builder`, :func:`open_controller`) for a caller that needs no HTTP application, its
own index, or a fresh controller per configuration over one engine (``bench.e2e``). The engine is
the in-process vLLM engine (KV-cache events on, so the knowledge tree mirrors the prefix cache
exactly) or, with ``engine_url``, any OpenAI-compatible server (mirrored through the KV events it
publishes over TCP when ``engine_kv_events`` says where); either way it is supervised: a
dead or hung engine is replaced, and on every replacement the tree forgets what it believed
cached and the KV mirror resubscribes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from specrag.controller.controller import ControllerConfig, RagController
from specrag.errors import InvalidInputError
from specrag.pipeline.config import EngineConfig, KVEventSource
from specrag.pipeline.engine import Engine
from specrag.pipeline.prompt import PromptBuilder
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.assets import Assets
from specrag.service.kv_mirror import KVMirror
from specrag.service.metrics import ServiceMetrics
from specrag.service.server import DEFAULT_MAX_QUERIES, DEFAULT_MAX_QUERIES_PER_CLIENT, create_app
from specrag.service.supervisor import SupervisedEngine, SupervisorPolicy


@dataclass(frozen=True)
class ServiceOptions:
    """Everything that shapes a service besides the assets."""

    controller: ControllerConfig = field(default_factory=ControllerConfig)
    engine_url: str | None = None
    engine_kv_events: str | None = None
    eager: bool = False
    omp_threads_bind: str | None = None
    api_token: str | None = None
    supervisor: SupervisorPolicy = field(default_factory=SupervisorPolicy)
    max_queries: int = DEFAULT_MAX_QUERIES
    max_queries_per_client: int = DEFAULT_MAX_QUERIES_PER_CLIENT

    def __post_init__(self) -> None:
        if self.engine_kv_events is not None:
            if self.engine_url is None:
                raise InvalidInputError(
                    "--engine-kv-events needs --engine-url (the in-process engine's events are always on)"
                )
            KVEventSource.remote(self.engine_kv_events)  # a malformed endpoint fails before any start


@dataclass
class Service:
    """The parts of a running service, for callers (tests, benchmarks) that look inside."""

    app: web.Application
    controller: RagController
    engine: SupervisedEngine
    mirror: KVMirror | None
    kv_events: KVEventSource | None


def _engine_starter(
    model_dir: Path, options: ServiceOptions, run_dir: Path
) -> tuple[Callable[[], Awaitable[Engine]], KVEventSource | None]:
    if options.engine_url is not None:
        from specrag.pipeline.http_engine import HttpEngine

        url = options.engine_url
        remote_events = options.engine_kv_events
        source = KVEventSource.remote(remote_events) if remote_events is not None else None

        async def connect() -> Engine:
            return await HttpEngine.connect(url)

        return connect, source
    from specrag.pipeline.vllm_engine import VllmEngine

    config = EngineConfig(
        model=str(model_dir), enforce_eager=options.eager, omp_threads_bind=options.omp_threads_bind
    ).with_kv_events(run_dir)

    async def start() -> Engine:
        return await VllmEngine.start(config)

    return start, config.kv_event_source()


@contextlib.asynccontextmanager
async def open_engine(
    model_dir: Path, options: ServiceOptions, run_dir: Path
) -> AsyncIterator[tuple[SupervisedEngine, KVEventSource | None]]:
    """The supervised engine and where its KV events are published (None: nowhere known).

    ``model_dir`` is the in-process engine's model; ``options.omp_threads_bind`` pins its model
    worker (benchmarks keep it off the vector search's core). Stopped on exit.
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
    """A controller whose knowledge tree mirrors the engine's prefix cache, and that mirror.

    The mirror follows the engine's KV events when ``kv_events`` says where they are (else the tree
    keeps its capacity model). A supervised engine's replacement empties the cache: the tree
    forgets it and the mirror resubscribes. ``empty_cache`` starts from an empty prefix cache, as
    every configuration of an experiment does; the mirror then skips the engine's event history.
    On exit the controller's queries are aborted and the mirror stops.
    """
    controller = RagController(engine, index, builder, config)
    mirror = KVMirror(controller.tree, kv_events) if kv_events is not None else None

    async def after_restart() -> None:
        controller.tree.engine_cache_cleared()
        if mirror is not None:  # the new engine numbers its event batches from zero again
            await mirror.stop()
            await mirror.start()

    # An engine that is not supervised is never replaced: there is no restart to follow.
    forget_restarts = engine.on_restart(after_restart) if isinstance(engine, SupervisedEngine) else None
    try:
        if empty_cache:
            await controller.reset_prefix_cache()
        if mirror is not None:
            await mirror.start(catch_up=not empty_cache)
        yield controller, mirror
    finally:
        if forget_restarts is not None:
            forget_restarts()
        await controller.close()
        if mirror is not None:
            await mirror.stop()


@contextlib.asynccontextmanager
async def open_service(assets: Assets, options: ServiceOptions, run_dir: Path) -> AsyncIterator[Service]:
    """Start the stack, yield it, and on exit abort queries in flight and stop the engine."""
    async with (
        open_engine(assets.model_dir, options, run_dir) as (engine, kv_events),
        open_controller(
            engine, kv_events, assets.index, prompt_builder(assets, engine), options.controller
        ) as (controller, mirror),
    ):
        metrics = ServiceMetrics()
        metrics.watch_prefill_profile(lambda: controller.tree.profile.measured)
        if mirror is not None:
            faults = mirror.faults
            metrics.watch_kv_mirror(lambda: faults().lost_batches, lambda: faults().callback_errors)
        app = create_app(
            controller,
            api_token=options.api_token,
            max_queries=options.max_queries,
            max_queries_per_client=options.max_queries_per_client,
            metrics=metrics,
        )
        yield Service(app, controller, engine, mirror, kv_events)
