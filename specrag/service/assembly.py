"""Assemble the running service: supervised engine, KV mirror, controller, HTTP application.

One place builds the whole stack so ``specrag serve``, ``specrag demo``, the fault benchmark and
the tests run the same thing. The engine is the in-process vLLM engine (KV-cache events on, so the
knowledge tree mirrors the prefix cache exactly) or, with ``engine_url``, any OpenAI-compatible
server; either way it is supervised: a dead or hung engine is replaced, and on every replacement
the tree forgets what it believed cached and the KV mirror resubscribes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from specrag.controller.controller import ControllerConfig, RagController
from specrag.pipeline.config import EngineConfig
from specrag.pipeline.engine import Engine
from specrag.pipeline.prompt import PromptBuilder
from specrag.service.assets import Assets
from specrag.service.kv_mirror import KVMirror
from specrag.service.server import DEFAULT_MAX_QUERIES, DEFAULT_MAX_QUERIES_PER_CLIENT, create_app
from specrag.service.supervisor import SupervisedEngine, SupervisorPolicy


@dataclass(frozen=True)
class ServiceOptions:
    """Everything that shapes a service besides the assets."""

    controller: ControllerConfig = field(default_factory=ControllerConfig)
    engine_url: str | None = None
    eager: bool = False
    omp_threads_bind: str | None = None
    api_token: str | None = None
    supervisor: SupervisorPolicy = field(default_factory=SupervisorPolicy)
    max_queries: int = DEFAULT_MAX_QUERIES
    max_queries_per_client: int = DEFAULT_MAX_QUERIES_PER_CLIENT


@dataclass
class Service:
    """The parts of a running service, for callers (tests, benchmarks) that look inside."""

    app: web.Application
    controller: RagController
    engine: SupervisedEngine
    mirror: KVMirror | None
    engine_config: EngineConfig | None


def _engine_starter(
    assets: Assets, options: ServiceOptions, run_dir: Path
) -> tuple[Callable[[], Awaitable[Engine]], EngineConfig | None]:
    if options.engine_url is not None:
        from specrag.pipeline.http_engine import HttpEngine

        url = options.engine_url

        async def connect() -> Engine:
            return await HttpEngine.connect(url)

        return connect, None
    from specrag.pipeline.vllm_engine import VllmEngine

    config = EngineConfig(
        model=str(assets.model_dir), enforce_eager=options.eager, omp_threads_bind=options.omp_threads_bind
    ).with_kv_events(run_dir)

    async def start() -> Engine:
        return await VllmEngine.start(config)

    return start, config


@contextlib.asynccontextmanager
async def open_service(assets: Assets, options: ServiceOptions, run_dir: Path) -> AsyncIterator[Service]:
    """Start the stack, yield it, and on exit abort queries in flight and stop the engine."""
    start, engine_config = _engine_starter(assets, options, run_dir)
    engine = await SupervisedEngine(start, options.supervisor).start()
    try:
        builder = PromptBuilder(assets.tokenizer, assets.store, block_size=engine.block_size)
        controller = RagController(engine, assets.index, builder, options.controller)
        mirror = KVMirror(controller.tree, engine_config) if engine_config is not None else None

        async def after_restart() -> None:
            controller.tree.engine_cache_cleared()
            if mirror is not None:  # the new engine numbers its event batches from zero again
                await mirror.stop()
                await mirror.start()

        engine.on_restart(after_restart)
        if mirror is not None:
            await mirror.start()
        try:
            app = create_app(
                controller,
                api_token=options.api_token,
                max_queries=options.max_queries,
                max_queries_per_client=options.max_queries_per_client,
            )
            yield Service(app, controller, engine, mirror, engine_config)
        finally:
            await controller.close()
            if mirror is not None:
                await mirror.stop()
    finally:
        await engine.close()
