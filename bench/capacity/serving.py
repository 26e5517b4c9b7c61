"""``python -m bench.capacity.serving``: one front end (specrag's service, or the thin baseline)
over stand-in replicas, in a process of its own with CPU meters, until SIGTERM.

The front serves on ``--port``, its questions embedded in process (MiniLM) or, with
``--embedding-url``, by that embedding server as ``serve --embedder openai`` has them embedded.
``GET /bench/state`` on ``--control-port`` reports its CPU seconds
per component (:mod:`bench.capacity.meters`) and, for specrag, each KV mirror's state. The meters
wrap the functions doing each part, in this process only: the product's code is not changed.
``POST /bench/profile/start`` and ``/bench/profile/stop`` (``bench.capacity --profile``) run the
sampling profiler (:mod:`bench.capacity.profile_sampler`) between them; stop answers its figures.

specrag is told the stand-ins' per-step token budget, as its warning asks an operator to do for
an engine server that does not report one: assumed at a CPU engine's 512 tokens, its prefill
pool would hold one final prompt per replica and queue the rest, where each stand-in computes
8,192 tokens a step. The thin front runs with its start's heap frozen as the service's is
(:func:`~specrag.service.run.heap.frozen_heap`), so that neither pays full collections of it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
from aiohttp import web

from bench.capacity.meters import CpuMeters
from bench.capacity.profile_sampler import FrameSampler, largest
from bench.capacity.thin import thin_app
from specrag.cache.tree import KnowledgeTree
from specrag.controller.config import ControllerConfig
from specrag.controller.placement import Placement
from specrag.paths import DataLayout
from specrag.pipeline.engines.http_engine import HttpEngine
from specrag.pipeline.kv_mirror.mirror import KVMirror
from specrag.pipeline.kv_mirror.sequence import EventSequence
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.backends.registry import data_directory
from specrag.retrieval.embedders.http_embedder import OpenAIEmbedder
from specrag.retrieval.embedders.served import MINILM_SERVED_NAMES
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.http.access import Access
from specrag.service.http.app import serving
from specrag.service.run.assembly import open_service, prompt_builder
from specrag.service.run.assets import Assets, ensure_assets
from specrag.service.run.heap import frozen_heap
from specrag.service.run.options import ServiceOptions
from specrag.service.run.pinning import pin_threads
from specrag.sim.gpu_server.time_model import TimeModel

HOST = "127.0.0.1"
UNLIMITED = 1_000_000  # a capacity run is bounded by its offered rate, not by admission limits


def install_meters() -> CpuMeters:
    meters = CpuMeters()
    meters.wrap(VectorIndex, "embed_query", "embedding")
    meters.wrap(VectorIndex, "search", "search")
    meters.wrap(Placement, "place_documents", "ordering")
    meters.wrap(Placement, "place_prompt", "ordering")
    meters.wrap(EventSequence, "deliver", "mirror")  # on the receiving thread: decode and order
    meters.wrap(KnowledgeTree, "apply_events", "mirror")  # on the loop: the tree follows the events
    meters.wrap(PromptBuilder, "question_tokens", "prompt")
    meters.wrap(PromptBuilder, "build_with_question_tokens", "prompt")
    return meters


def mirror_state(mirror: KVMirror) -> dict[str, Any]:
    faults, status = mirror.faults(), mirror.status
    state: dict[str, Any] = {"exact": status.exact, "reason": status.reason, **asdict(faults)}
    return {**state, "lag": asdict(mirror.lag())}


def profile_figures(sampler: FrameSampler) -> dict[str, Any]:
    """A finished profile's CPU seconds by component and its top frames (self and inclusive)."""
    profile = sampler.profile
    return {
        "by_component_s": dict(profile.by_component),
        "top_self_s": largest(profile.self_sites, 40),
        "top_inclusive_s": largest(profile.inclusive_sites, 80),
        "process_cpu_s": profile.process_cpu_s,
        "loop_thread_cpu_s": profile.loop_thread_cpu_s,
        "sampler_cpu_s": profile.sampler_cpu_s,
        "samples": profile.samples,
    }


async def serve_front(args: argparse.Namespace, stop: asyncio.Event) -> None:
    meters = install_meters()
    server = OpenAIEmbedder(args.embedding_url, MINILM_SERVED_NAMES[0]) if args.embedding_url else None
    assets: Assets = await asyncio.to_thread(
        ensure_assets,
        DataLayout(Path(args.data_dir)),
        args.model,
        backend=data_directory(query_embedder=server),
    )
    mirrors: list[KVMirror] = []

    async def state(_: web.Request) -> web.Response:
        return web.json_response({"cpu": meters.snapshot(), "mirrors": [mirror_state(m) for m in mirrors]})

    sampling: list[FrameSampler] = []  # the profile running, if any

    async def profile_start(_: web.Request) -> web.Response:
        if not sampling:  # the sampler's signal handler is set here, in the loop's (main) thread
            sampling.append(FrameSampler().__enter__())
        return web.json_response({"started": True})

    async def profile_stop(_: web.Request) -> web.Response:
        if not sampling:
            raise web.HTTPConflict(text="no profile is running")
        sampler = sampling.pop()
        sampler.__exit__(None, None, None)
        return web.json_response(profile_figures(sampler))

    control = web.Application()
    control.router.add_get("/bench/state", state)
    control.router.add_post("/bench/profile/start", profile_start)
    control.router.add_post("/bench/profile/stop", profile_stop)
    async with contextlib.AsyncExitStack() as stack:
        if args.front == "specrag":
            options = ServiceOptions(
                controller=ControllerConfig(batched_token_budget=TimeModel.max_num_batched_tokens),
                engine_urls=tuple(args.engine_url),
                engine_kv_events=tuple(args.engine_kv_events),
                access=Access(max_queries=UNLIMITED, max_queries_per_client=UNLIMITED),
            )
            run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="capacity-")))
            service = await stack.enter_async_context(open_service(assets, options, run_dir))
            mirrors.extend(service.mirrors)
            app = service.app
        else:
            engines = [await HttpEngine.connect(url) for url in args.engine_url]
            for engine in engines:
                stack.push_async_callback(engine.close)
            app = thin_app(assets.index, prompt_builder(assets, engines[0]), engines, args.k)
            stack.enter_context(frozen_heap())
        await stack.enter_async_context(serving(app, HOST, args.port, access_log=False))
        await stack.enter_async_context(serving(control, HOST, args.control_port, access_log=False))
        if args.cpus:  # once started (on every core): every thread of this process, and later ones
            pin_threads(psutil.Process(), {int(core) for core in args.cpus.split(",")})
        print("ready", flush=True)
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.capacity.serving")
    parser.add_argument("--front", choices=("specrag", "thin"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--control-port", type=int, required=True)
    parser.add_argument("--engine-url", action="append", required=True)
    parser.add_argument("--engine-kv-events", action="append", default=[])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--model")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--cpus", help="cores of this process once it serves, e.g. 0")
    parser.add_argument("--embedding-url", help="questions embedded by this embedding server, not in process")
    args = parser.parse_args()

    async def run() -> None:
        stop = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        await serve_front(args, stop)

    asyncio.run(run())


if __name__ == "__main__":
    main()
