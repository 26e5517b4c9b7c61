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

With ``ray`` set, :func:`open_ray_service` runs several vLLM replicas as Ray actors instead
(:mod:`specrag.pipeline.ray_engine`), each with its own tree fed by its own KV events, behind
the router of :mod:`specrag.controller.placement`; Ray restarts a dead replica and the router's
health checks bring it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from specrag.controller.controller import ControllerConfig, RagController, new_tree
from specrag.controller.placement import Placement, health_checks
from specrag.controller.replicas import Replica
from specrag.errors import EngineError, InvalidInputError
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
    # Ray: None for no Ray, "" for a local instance (or $RAY_ADDRESS), else a cluster's address.
    ray_address: str | None = None
    replicas: int = 1
    router: str = "specrag"

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

    def begin_shutdown(self) -> None:
        """From now on new queries get 503 and engine failures are the shutdown's, not faults."""
        self.engine.begin_shutdown()


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


@dataclass
class RayService:
    """The parts of a service over Ray replicas, for callers that look inside."""

    app: web.Application
    controller: RagController
    placement: Placement

    def begin_shutdown(self) -> None:
        """Nothing to tell: Ray replicas have no supervisor of ours that could mistake the
        shutdown for a fault (the placement's health checks stop with it)."""


@contextlib.asynccontextmanager
async def open_ray_placement(
    base: EngineConfig, options: ServiceOptions, system_token_ids: Sequence[int]
) -> AsyncIterator[Placement]:
    """``options.replicas`` vLLM replicas of ``base`` as Ray actors behind the router; all stopped on exit.

    Connects to the cluster at ``options.ray_address`` (or starts a local instance, shut down
    on exit). Each replica's KV events go to a port chosen free on this machine; each replica's
    tree is fed by its own subscriber, resubscribed whenever the replica rejoins (Ray restarted it).
    """
    import ray

    from specrag.pipeline.ray_engine import RayEngine, replica_config, subscriber_config

    if options.replicas < 1:
        raise InvalidInputError(f"--replicas must be at least 1, got {options.replicas}")
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=options.ray_address or None, include_dashboard=False, log_to_driver=False)
    mirrors: list[KVMirror] = []
    engines: list[RayEngine] = []
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        configs = [replica_config(base, i, free_port_pair(), cpus) for i in range(options.replicas)]
        starts = [RayEngine.start(config, f"r{i}") for i, config in enumerate(configs)]
        outcomes = await asyncio.gather(*starts, return_exceptions=True)
        engines += [started for started in outcomes if isinstance(started, RayEngine)]
        failures = [str(error) for error in outcomes if isinstance(error, BaseException)]
        if failures:
            raise EngineError(f"{len(failures)} of {len(configs)} Ray replicas did not start: {failures[0]}")
        replicas = []
        for engine, config in zip(engines, configs, strict=True):
            tree = new_tree(engine, system_token_ids)
            mirror = KVMirror(tree, subscriber_config(config, engine.node_ip))
            await mirror.start()
            mirrors.append(mirror)
            replica = Replica(engine.name, engine, tree)
            replica.rejoin_hooks.append(mirror.restart)
            replicas.append(replica)
        placement = Placement(replicas, router=options.router)
        async with health_checks(placement):
            yield placement
    finally:
        for mirror in mirrors:
            await mirror.stop()
        for engine in engines:
            await engine.close()
        if started_ray:
            ray.shutdown()


@contextlib.asynccontextmanager
async def open_ray_service(assets: Assets, options: ServiceOptions) -> AsyncIterator[RayService]:
    """The service over Ray replicas (see :func:`open_ray_placement`)."""
    base = EngineConfig(model=str(assets.model_dir), enforce_eager=options.eager)
    # Each tree predicts the system prompt as it starts every prompt: padded to the engine's blocks.
    builder = PromptBuilder(assets.tokenizer, assets.store, block_size=base.block_size)
    system_token_ids = builder.system_layout_tokens()
    async with open_ray_placement(base, options, system_token_ids) as placement:
        builder = prompt_builder(assets, placement.replicas[0].engine)
        controller = RagController(placement, assets.index, builder, options.controller)
        try:
            app = create_app(
                controller,
                api_token=options.api_token,
                max_queries=options.max_queries,
                max_queries_per_client=options.max_queries_per_client,
            )
            yield RayService(app, controller, placement)
        finally:
            await controller.close()


def free_port_pair() -> int:
    """A port P with P and P+1 free on this machine (KV events and their replay socket)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("0.0.0.0", 0))
            port = int(probe.getsockname()[1])
        with socket.socket() as second, contextlib.suppress(OSError):
            second.bind(("0.0.0.0", port + 1))
            return port
