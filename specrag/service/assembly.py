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

Several engines make a pool: N in-process vLLM engines (each pinned to its own core, each
publishing its own KV events), N separate engine servers (one URL each), or N vLLM replicas as Ray
actors (:mod:`specrag.pipeline.ray_engine`). One engine is a pool of one: whatever their kind and
number, one function (:func:`open_pool`) gives each engine its replica (its own tree fed by its
own KV events, its restart hook) and puts them behind the router of
:mod:`specrag.controller.placement`, whose health checks bring an excluded engine back; one
:class:`Service` holds the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import psutil
from aiohttp import web

from specrag.cache.tree import KnowledgeTree
from specrag.controller.controller import ControllerConfig, RagController
from specrag.controller.placement import Placement, Router, health_checks
from specrag.controller.replicas import Replica
from specrag.errors import EngineError, InvalidInputError
from specrag.pipeline.config import EngineConfig, KVEventSource, model_context_length, parse_cpus
from specrag.pipeline.engine import Engine
from specrag.pipeline.model_dir import served_model_name
from specrag.pipeline.prompt import PromptBuilder
from specrag.retrieval.search_runner import SearchRunner
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.assets import Assets
from specrag.service.kv_mirror import KVMirror
from specrag.service.metrics import ServiceMetrics
from specrag.service.pinning import descendant_pids, pin_engine_processes, pin_threads
from specrag.service.server import DEFAULT_MAX_QUERIES, DEFAULT_MAX_QUERIES_PER_CLIENT, create_app
from specrag.service.supervisor import SupervisedEngine, SupervisorPolicy


@dataclass(frozen=True)
class ServiceOptions:
    """Everything that shapes a service besides the assets."""

    controller: ControllerConfig = field(default_factory=ControllerConfig)
    # Separate engine servers (one makes the service's engine, several a pool), and where each
    # publishes its KV events (none, or one per URL in the same order).
    engine_urls: tuple[str, ...] = ()
    engine_kv_events: tuple[str, ...] = ()
    eager: bool = False
    # Cores of the in-process engine (vLLM's OMP_THREADS_BIND form, "0" or "0-1"), and of this
    # process with its vector search: see specrag.service.pinning. None leaves them where they are.
    engine_cpus: str | None = None
    search_cpus: str | None = None
    api_token: str | None = None
    # Several bearer tokens, one per client: the token then tells clients apart (server.py).
    api_tokens: tuple[str, ...] = ()
    trust_forwarded_for: bool = False
    supervisor: SupervisorPolicy = field(default_factory=SupervisorPolicy)
    max_queries: int = DEFAULT_MAX_QUERIES
    max_queries_per_client: int = DEFAULT_MAX_QUERIES_PER_CLIENT
    # Ray: None for no Ray, "" for a local instance (or $RAY_ADDRESS), else a cluster's address.
    ray_address: str | None = None
    # In-process engines (or Ray replicas with ``ray_address``).
    replicas: int = 1
    router: Router = "specrag"
    # TurboRAG: the document KV store's directory; None keeps it off (see docs/turbo.md).
    document_kv_dir: str | None = None
    document_kv_max_gib: float = EngineConfig.document_kv_max_gib

    def __post_init__(self) -> None:
        """Bad combinations fail here, before any engine starts (flag names: ``specrag serve``'s)."""
        if self.replicas < 1:
            raise InvalidInputError(f"--replicas must be at least 1, got {self.replicas}")
        if self.engine_urls and self.ray_address is not None:
            raise InvalidInputError("--ray and --engine-url exclude each other (Ray starts its own engines)")
        if self.engine_urls and self.replicas > 1:
            raise InvalidInputError(
                "--replicas starts in-process engines; to pool engine servers, repeat --engine-url"
            )
        _check_distinct("--engine-url", self.engine_urls)
        if self.document_kv_max_gib <= 0:
            raise InvalidInputError(f"--document-kv-max-gib must be positive, got {self.document_kv_max_gib}")
        if self.document_kv_dir is not None and (self.engine_urls or self.ray_address is not None):
            raise InvalidInputError(
                "--document-kv turbo needs the in-process engine (no --engine-url, no --ray)"
            )
        if self.engine_kv_events:
            if not self.engine_urls:
                raise InvalidInputError(
                    "--engine-kv-events needs --engine-url (the in-process engine's events are always on)"
                )
            if len(self.engine_kv_events) != len(self.engine_urls):
                raise InvalidInputError(
                    f"give one --engine-kv-events per --engine-url, in the same order: got "
                    f"{len(self.engine_kv_events)} for {len(self.engine_urls)} engines"
                )
            for endpoint in self.engine_kv_events:  # a malformed endpoint fails before any start
                KVEventSource.remote(endpoint)
            _check_distinct("--engine-kv-events", self.engine_kv_events)
        if self.router != "specrag" and not self.pooled:
            raise InvalidInputError(
                "--router needs several engines: --replicas N, a repeated --engine-url, or --ray"
            )
        self._check_cpus()

    def _check_cpus(self) -> None:
        """Pinning applies to one in-process engine and to this process; pools place themselves."""
        in_process = not self.engine_urls and self.ray_address is None
        engine: frozenset[int] = frozenset()
        if self.engine_cpus is not None:
            if not in_process or self.replicas > 1:
                raise InvalidInputError(
                    "--engine-cpus pins the one in-process engine; a pool of --replicas puts replica i "
                    "on core i itself, and an --engine-url server or a Ray replica is placed by its host"
                )
            engine = parse_cpus(self.engine_cpus, "--engine-cpus")
        if self.search_cpus is not None:
            search = parse_cpus(self.search_cpus, "--search-cpus")
            if in_process and self.replicas > 1:
                raise InvalidInputError(
                    "--search-cpus: a pool of --replicas already takes one core per replica"
                )
            if in_process and self.engine_cpus is None:
                raise InvalidInputError(
                    "--search-cpus pins this process, where the in-process engine is started and restarted: "
                    "give --engine-cpus too, on other cores"
                )
            if engine & search:
                raise InvalidInputError(
                    f"--engine-cpus and --search-cpus share cores {sorted(engine & search)}: "
                    "overlap needs them apart"
                )

    @property
    def pooled(self) -> bool:
        """Whether the engines make a pool behind a router (several engines, or Ray's replicas)."""
        return self.ray_address is not None or self.replicas > 1 or len(self.engine_urls) > 1


def _check_distinct(flag: str, values: Sequence[str]) -> None:
    """Two replicas on one server would each believe they own its cache: refuse repeats."""
    repeated = sorted({value for value in values if values.count(value) > 1})
    if repeated:
        raise InvalidInputError(f"{flag} given twice for the same engine: {', '.join(repeated)}")


def base_engine_config(model_dir: Path, options: ServiceOptions) -> EngineConfig:
    """The in-process engines' settings (each replica of a pool derives its own from them).

    The context is the default's, or the model's own when it is shorter (vLLM refuses more).
    """
    default = EngineConfig.max_model_len
    return EngineConfig(
        model=str(model_dir),
        max_model_len=min(default, model_context_length(model_dir) or default),
        enforce_eager=options.eager,
        omp_threads_bind=options.engine_cpus,
        document_kv_dir=options.document_kv_dir,
        document_kv_max_gib=options.document_kv_max_gib,
    )


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
        return _connector(url), KVEventSource.remote(remote_events) if remote_events is not None else None
    config = base_engine_config(model_dir, options).with_kv_events(run_dir)
    pin_to = None if options.engine_cpus is None else parse_cpus(options.engine_cpus, "--engine-cpus")
    return _starter(config, pin_to), config.kv_event_source()


def _connector(url: str) -> Callable[[], Awaitable[Engine]]:
    """Connects to the engine server at ``url`` (again on every supervisor restart)."""
    from specrag.pipeline.http_engine import HttpEngine

    async def connect() -> Engine:
        return await HttpEngine.connect(url)

    return connect


def _starter(config: EngineConfig, pin_to: frozenset[int] | None = None) -> Callable[[], Awaitable[Engine]]:
    """Starts an in-process vLLM engine with ``config`` (again on every supervisor restart).

    With ``pin_to``, every thread of the engine's processes is pinned there once it runs (see
    specrag.service.pinning: vLLM's own binding reaches only the model worker's compute threads).
    """
    from specrag.pipeline.vllm_engine import VllmEngine

    async def start() -> Engine:
        if pin_to is None:
            return await VllmEngine.start(config)
        others = descendant_pids()  # another engine of this process (a test's, a benchmark's) stays put
        engine = await VllmEngine.start(config)
        pin_engine_processes(pin_to, besides=others)
        return engine

    return start


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
async def open_service(assets: Assets, options: ServiceOptions, run_dir: Path) -> AsyncIterator[Service]:
    """Start the stack, yield it, and on exit abort queries in flight and stop the engines.

    One path for every service: the engines (one supervised engine, or a pool's, see
    :class:`ServiceOptions`) -> their replicas, each with its tree, KV mirror and restart hook
    (:func:`open_pool`) -> the placement -> the controller -> the application. ``run_dir`` holds
    in-process engines' KV-event sockets.
    """
    async with _engines(assets, options, run_dir) as engines:
        with searching_on(assets.index, options.search_cpus):
            # Each tree predicts the system prompt as it starts every prompt: padded to the engines' blocks.
            builder = prompt_builder(assets, engines[0].engine)
            async with open_pool(engines, builder.system_layout_tokens(), options.router) as pool:
                controller = RagController(pool.placement, assets.index, builder, options.controller)
                try:
                    app = _application(controller, options, pool.mirrors, served_model_name(assets.model_dir))
                    yield Service(app, controller, pool.placement, pool.mirrors)
                finally:
                    await controller.close()


def _application(
    controller: RagController, options: ServiceOptions, mirrors: Sequence[KVMirror], model_name: str
) -> web.Application:
    """The HTTP application over ``controller``, its metrics watching the profile and the mirrors;
    ``model_name`` is the model it answers with, as ``/v1/models`` and every response name it."""
    metrics = ServiceMetrics()
    replicas = controller.placement.replicas
    metrics.watch_prefill_profile(lambda: all(replica.tree.profile.measured for replica in replicas))
    if mirrors:
        metrics.watch_kv_mirror(
            lambda: sum(mirror.faults().lost_batches for mirror in mirrors),
            lambda: sum(mirror.faults().callback_errors for mirror in mirrors),
        )
    return create_app(
        controller,
        api_token=options.api_token,
        api_tokens=options.api_tokens,
        trust_forwarded_for=options.trust_forwarded_for,
        max_queries=options.max_queries,
        max_queries_per_client=options.max_queries_per_client,
        metrics=metrics,
        model_name=model_name,
    )


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
    router: Router = "specrag",
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
            mirror = KVMirror(replica.tree, member.kv_events) if member.kv_events is not None else None
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
    starts = [_supervised(_starter(config), options) for config in configs]
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
    starts = [_supervised(_connector(url), options) for url in options.engine_urls]
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

    from specrag.pipeline.ray_engine import RayEngine, replica_config, subscriber_config

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


def _engines(
    assets: Assets, options: ServiceOptions, run_dir: Path
) -> contextlib.AbstractAsyncContextManager[list[PoolEngine]]:
    """The service's engines, of the kind and number the options ask for (:class:`ServiceOptions`)."""
    if not options.pooled:
        return _one_engine(assets, options, run_dir)
    if options.ray_address is not None:
        return open_ray_engines(base_engine_config(assets.model_dir, options), options)
    if options.engine_urls:
        return open_remote_engines(options)
    return open_local_engines(base_engine_config(assets.model_dir, options), options, run_dir)


@contextlib.asynccontextmanager
async def _one_engine(
    assets: Assets, options: ServiceOptions, run_dir: Path
) -> AsyncIterator[list[PoolEngine]]:
    """The one supervised engine of a service that is not pooled, as a pool of one (replica "0")."""
    async with open_engine(assets.model_dir, options, run_dir) as (engine, kv_events):
        yield [PoolEngine("0", engine, kv_events)]


def free_port_pair() -> int:
    """A port P with P and P+1 free on this machine (KV events and their replay socket)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("0.0.0.0", 0))
            port = int(probe.getsockname()[1])
        with socket.socket() as second, contextlib.suppress(OSError):
            second.bind(("0.0.0.0", port + 1))
            return port
