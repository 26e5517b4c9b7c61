"""vLLM replicas as Ray actors: placement, streaming, aborts and fault detection are Ray's.

Each replica is an async Ray actor running the unchanged :class:`VllmEngine` (vLLM switches its
worker start method to ``spawn`` inside the actor by itself). :class:`RayEngine` is the
:class:`~specrag.pipeline.engines.protocol.Engine` the controller sees on the caller's side:

- **Streaming**: the actor's ``generate`` is an async generator; the caller iterates the
  streaming ``ObjectRefGenerator`` and awaits each output (its cost per request and per token:
  docs/scale-out.md).
- **Aborts** are explicit: dropping the caller's generator does *not* stop the request in the
  actor, so leaving a stream early calls the actor's ``abort`` (as every adapter does).
- **Placement**: a GPU per replica when the cluster has them; otherwise a CPU, and the replica's
  vLLM worker is pinned to its own core (``omp_threads_bind``), or two replicas on one machine
  would both bind core 0. A replica Ray cannot place is said within a bound
  (:mod:`~specrag.ray_placement`), not waited for.
- **Faults**: a killed actor reaches the caller as ``ActorDiedError`` within milliseconds, turned
  into :class:`EngineError` here (the router then excludes the replica). A dead engine core inside
  a live actor fails every request; the actor then checks its engine and, if it no longer
  computes, exits with an error so that Ray restarts it (``max_restarts``). A restarted actor
  starts a fresh vLLM on its first call, so the router's health probe brings it back.
- **KV events**: each replica publishes on its own TCP port and topic, bound inside the actor to
  its node's address (the one Ray itself uses, so a caller on another node reaches it; not every
  interface), and the caller's subscriber connects there.

No cluster manager of our own: Ray places, restarts and reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError

from specrag.errors import EngineError
from specrag.pipeline.engines.base import DescribedEngine
from specrag.pipeline.engines.config import EngineConfig, KVEventSource
from specrag.pipeline.engines.protocol import EngineCounts, EngineOutput, EngineShape, Sampling, now
from specrag.pipeline.engines.ray_placement import replica_options
from specrag.ray_placement import PLACEMENT_WAIT_S, unplaced

__all__ = [
    "EngineActor",
    "RayEngine",
    "ReplicaInfo",
    "on_node",
    "replica_config",
    "subscriber_config",
]

logger = logging.getLogger(__name__)

# A one-token prompt: what the actor computes to tell a live engine from a dead one.
_PROBE_PROMPT = (1,)
_PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ReplicaInfo(EngineShape):
    """What a started replica reports about itself: its shape, and where its events are."""

    node_ip: str


class EngineActor:
    """The actor's body: one :class:`VllmEngine`, started on the first call (also after a restart)."""

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._engine: Any = None
        self._starting = asyncio.Lock()

    async def _ready(self) -> Any:
        async with self._starting:
            if self._engine is None:
                from specrag.pipeline.engines.vllm_engine import VllmEngine

                config = on_node(self._config, ray.util.get_node_ip_address())
                self._engine = await VllmEngine.start(config)
            return self._engine

    async def info(self) -> ReplicaInfo:
        engine = await self._ready()
        return ReplicaInfo(
            engine.block_size, engine.max_model_len, engine.kv_capacity_tokens, ray.util.get_node_ip_address()
        )

    async def generate(
        self, request_id: str, prompt: list[int], sampling: Sampling
    ) -> AsyncGenerator[EngineOutput, None]:
        engine = await self._ready()
        try:
            async for output in engine.generate(request_id, prompt, sampling):
                yield output
        except EngineError:
            await self._exit_if_dead(engine)
            raise

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    async def counts(self) -> EngineCounts:
        counts: EngineCounts = await (await self._ready()).counts()
        return counts

    async def reset_prefix_cache(self) -> None:
        await (await self._ready()).reset_prefix_cache()

    async def close(self) -> None:
        if self._engine is not None:
            await self._engine.close()

    async def _exit_if_dead(self, engine: Any) -> None:
        """A request failed: if the engine no longer computes, die so that Ray restarts us."""
        try:
            async with asyncio.timeout(_PROBE_TIMEOUT_S):
                await engine.warm(_PROBE_PROMPT, f"probe-{os.getpid()}-{now()}")
        except (EngineError, TimeoutError) as error:
            logger.error(
                "the engine inside this replica no longer computes (%s): exiting for a restart", error
            )
            with contextlib.suppress(Exception):
                await asyncio.wait_for(engine.close(), 15)
            os._exit(1)  # a failure, not exit_actor(): Ray restarts the actor (max_restarts)


class RayEngine(DescribedEngine):
    """:class:`~specrag.pipeline.engines.protocol.Engine` over one replica actor (module doc)."""

    _info: ReplicaInfo

    def __init__(self, actor: Any, info: ReplicaInfo, name: str) -> None:
        super().__init__()
        self._actor = actor
        self._info = info
        self.name = name

    @classmethod
    async def start(
        cls, config: EngineConfig, name: str, *, max_restarts: int = 3, place_s: float = PLACEMENT_WAIT_S
    ) -> RayEngine:
        """Place one replica on the running Ray cluster (``ray.init`` first) and wait until it
        serves; a replica Ray has not placed within ``place_s`` is an EngineError saying what it
        waits for (:func:`~specrag.ray_placement.unplaced`)."""
        resources = replica_options(ray.cluster_resources())
        actor_class: Any = ray.remote(EngineActor)
        actor: Any = actor_class.options(
            name=f"specrag-engine-{name}", max_restarts=max_restarts, max_task_retries=0, **resources
        ).remote(config)
        try:
            try:
                await asyncio.wait_for(actor.__ray_ready__.remote(), place_s)
            except TimeoutError:
                fix = (
                    "fewer --replicas or --search-shards, a smaller --search-shard-cpus, or a larger cluster"
                )
                raise EngineError(unplaced(f"engine replica {name}", resources, place_s, fix)) from None
            info = await actor.info.remote()
        except RayError as error:
            ray.kill(actor, no_restart=True)
            raise EngineError(f"replica {name} did not start: {_cause(error)}") from error
        except EngineError:
            ray.kill(actor, no_restart=True)
            raise
        return cls(actor, info, name)

    @property
    def node_ip(self) -> str:
        return self._info.node_ip

    @property
    def honours_penalties(self) -> bool:
        return True  # the replica's engine is the in-process vLLM engine, which applies them

    async def _stream(
        self, request_id: str, prompt: list[int], sampling: Sampling
    ) -> AsyncGenerator[EngineOutput, None]:
        stream = self._actor.generate.options(num_returns="streaming").remote(request_id, prompt, sampling)
        try:
            async for reference in stream:
                output: EngineOutput = await reference
                yield replace(output, received_at=now())
        except RayError as error:
            raise EngineError(f"replica {self.name}: request {request_id} failed: {_cause(error)}") from error

    async def _abort_request(self, request_id: str) -> None:
        if not self.closed:
            with contextlib.suppress(RayError):  # a dead actor runs nothing to abort
                await self._actor.abort.remote(request_id)

    async def _counts(self) -> EngineCounts:
        try:
            counts: EngineCounts = await self._actor.counts.remote()
        except RayError as error:
            raise EngineError(f"replica {self.name}: {_cause(error)}") from error
        return counts

    async def _reset_prefix_cache(self) -> bool:
        """The actor's engine confirms its reset itself (it raises when vLLM refuses one)."""
        try:
            await self._actor.reset_prefix_cache.remote()
        except RayError as error:
            raise EngineError(f"replica {self.name}: {_cause(error)}") from error
        return True

    async def _shut_down(self) -> None:
        with contextlib.suppress(RayError):
            await asyncio.wait_for(self._actor.close.remote(), 30)
        with contextlib.suppress(RayError, TimeoutError):
            ray.kill(self._actor, no_restart=True)

    def kill(self) -> None:
        """Kill the actor as a crash would (Ray may restart it): for fault tests and benchmarks."""
        ray.kill(self._actor, no_restart=False)


def _cause(error: RayError) -> str:
    """The error the actor raised (an :class:`EngineError`'s message), or Ray's own (actor died)."""
    if isinstance(error, RayTaskError) and error.cause is not None:
        return str(error.cause)
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def replica_config(base: EngineConfig, number: int, kv_port: int, cpus: int) -> EngineConfig:
    """Replica ``number``'s engine settings: its own core on CPU, its own KV-event port and topic.

    Its KV-event host is left open (``*``) until the actor knows its node (:func:`on_node`).
    """
    return base.pinned_to(number % max(cpus, 1)).with_tcp_kv_events("*", kv_port, topic=f"kv-{number}")


def _kv_port(config: EngineConfig) -> int | None:
    """The KV-event port :func:`replica_config` gave the replica (None: it publishes none)."""
    endpoint = config.kv_events_endpoint
    return None if endpoint is None else int(endpoint.rpartition(":")[2])


def on_node(config: EngineConfig, node_ip: str) -> EngineConfig:
    """A replica's settings with its KV events bound to its node's address instead of every
    interface: the actor learns that address only once Ray has placed it."""
    port = _kv_port(config)
    if port is None:
        return config
    return config.with_tcp_kv_events(node_ip, port, topic=config.kv_events_topic)


def subscriber_config(config: EngineConfig, node_ip: str) -> KVEventSource:
    """Where the caller's subscriber finds a replica's KV events: where the actor bound them."""
    port = _kv_port(config)
    assert port is not None
    return KVEventSource.remote(f"tcp://{node_ip}:{port}", config.kv_events_topic)
