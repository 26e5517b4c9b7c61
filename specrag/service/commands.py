"""``specrag prepare``, ``serve`` and ``demo``: build the embedded default, serve it, query it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

from aiohttp import web

from specrag.client import AsyncClient
from specrag.controller.config import DEFAULT_STAGE_SCHEDULE
from specrag.controller.controller import ControllerConfig
from specrag.controller.modes import MODE_NAMES
from specrag.controller.placement import ROUTERS
from specrag.controller.speculation_policy import SPECULATION_SETTINGS
from specrag.errors import InvalidInputError
from specrag.paths import DataLayout, resolve_data_dir
from specrag.retrieval.stages import DEFAULT_STAGES, SCHEDULES
from specrag.service.assembly import ServiceOptions, open_pool_service, open_service
from specrag.service.assets import Assets, ensure_assets
from specrag.service.demo import DEMO_QUESTIONS, run_demo
from specrag.service.server import (
    DEFAULT_MAX_QUERIES,
    DEFAULT_MAX_QUERIES_PER_CLIENT,
    SHUTDOWN_GRACE_S,
    serving,
)

MAX_K = ControllerConfig().k_max


def _paths(args: argparse.Namespace) -> tuple[DataLayout, Path | None, Path | None]:
    layout = DataLayout(resolve_data_dir(args.data_dir))
    return layout, Path(args.model) if args.model else None, Path(args.corpus) if args.corpus else None


def _assets(args: argparse.Namespace) -> Assets:
    return ensure_assets(*_paths(args))


def _prepare(args: argparse.Namespace) -> int:
    assets = _assets(args)
    print(
        f"ready in {_paths(args)[0].root}: {len(assets.passages)} passages, model {assets.model_dir}, "
        f"store {assets.store.path.name} ({assets.store.info.total_tokens} tokens), "
        f"index {assets.index.searcher.ntotal} rows × {assets.index.dim} dims"
    )
    return 0


class RunningService(Protocol):
    """What ``serve`` and ``demo`` need of a running service, one engine or a pool."""

    @property
    def app(self) -> web.Application: ...

    def begin_shutdown(self) -> None: ...


@contextlib.asynccontextmanager
async def _service(
    args: argparse.Namespace, assets: Assets, options: ServiceOptions
) -> AsyncIterator[RunningService]:
    """The supervised engine(s), the controller and the application over them (see assembly.py).

    The run directory (the in-process engines' KV-event sockets) is this process's alone: it goes
    when the service stops.
    """
    print(_starting(assets, options), flush=True)
    run_dir = _paths(args)[0].root / "run" / f"serve-{os.getpid()}"
    try:
        opened = open_pool_service if options.pooled else open_service
        async with opened(assets, options, run_dir) as service:
            yield service
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _starting(assets: Assets, options: ServiceOptions) -> str:
    """What the service is about to start or connect to, said before the minute it may take."""
    if options.ray_address is not None:
        where = options.ray_address or "a local Ray instance"
        return f"starting {options.replicas} vLLM replicas on {where}…"
    if options.engine_urls:
        return f"connecting to the engine server(s) at {', '.join(options.engine_urls)}…"
    engines = f"{options.replicas} vLLM engines, one per core," if options.pooled else "vLLM"
    return f"starting {engines} on {assets.model_dir} (about a minute each on a small CPU machine)…"


def _api_token(variable: str | None) -> str | None:
    """The token from an environment variable: on the command line it would show in ``ps``."""
    if variable is None:
        return None
    token = os.environ.get(variable)
    if not token:
        raise InvalidInputError(f"--api-token-env: environment variable {variable} is not set or empty")
    return token


# The controller setting behind each ``serve`` flag, so that an error names the flag the user typed.
_FLAG_OF_SETTING = {
    "num_stages": "--stages",
    "stage_schedule": "--stage-schedule",
    "max_prefill_bs": "--max-prefill-bs",
    "max_queue": "--max-queue",
    "first_token_timeout_s": "--first-token-timeout",
    "speculation": "--speculation",
}


def _controller_config(args: argparse.Namespace) -> ControllerConfig:
    try:
        return ControllerConfig(
            mode=args.mode,
            num_stages=args.stages,
            stage_schedule=args.stage_schedule,
            max_prefill_bs=args.max_prefill_bs,
            max_queue=args.max_queue,
            first_token_timeout_s=args.first_token_timeout,
            speculation=args.speculation,
        ).validate()
    except InvalidInputError as error:
        message = str(error)
        for setting, flag in _FLAG_OF_SETTING.items():
            message = re.sub(rf"\b{setting}\b", flag, message)
        raise InvalidInputError(message) from None


def _serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise InvalidInputError(f"--port must be between 0 and 65535, got {args.port}")
    try:  # before the engine's minute-long start, not after it
        socket.getaddrinfo(args.host, args.port)
    except OSError as error:
        raise InvalidInputError(f"--host {args.host!r} cannot be bound: {error}") from None
    if args.max_queries < 1 or args.max_queries_per_client < 1:
        raise InvalidInputError("--max-queries and --max-queries-per-client must be at least 1")
    token = _api_token(args.api_token_env)
    config = _controller_config(args)
    options = ServiceOptions(
        controller=config,
        engine_urls=tuple(args.engine_url or ()),
        engine_kv_events=tuple(args.engine_kv_events or ()),
        eager=args.eager,
        api_token=token,
        max_queries=args.max_queries,
        max_queries_per_client=args.max_queries_per_client,
        ray_address=args.ray,
        replicas=args.replicas,
        router=args.router,
        engine_cpus=args.engine_cpus,
        search_cpus=args.search_cpus,
    )
    assets = _assets(args)

    async def main() -> None:
        async with _service(args, assets, options) as service:
            stop = asyncio.Event()

            def shut_down() -> None:
                # At once, in the handler: from now on new queries get 503 and engine failures
                # are the shutdown's, not faults to repair.
                service.begin_shutdown()
                stop.set()

            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, shut_down)
            async with serving(service.app, args.host, args.port) as url:
                print(f"specrag serving on {url} (mode {config.mode}; Ctrl-C to stop)", flush=True)
                await stop.wait()
                print(
                    f"stopping: new queries get 503, queries in flight have {SHUTDOWN_GRACE_S:g} s "
                    "to finish; then the engine shuts down…",
                    flush=True,
                )

    asyncio.run(main())
    return 0


def _demo(args: argparse.Namespace) -> int:
    if not 1 <= args.k <= MAX_K:
        raise InvalidInputError(f"-k must be between 1 and {MAX_K}, got {args.k}")
    if args.max_tokens < 1:
        raise InvalidInputError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    assets = _assets(args)

    async def main() -> None:
        async with (
            _service(args, assets, ServiceOptions(eager=args.eager)) as service,
            serving(service.app, access_log=False) as url,
            AsyncClient(url) as client,
        ):
            noise = "" if args.model else "; the embedded model has random weights: its text is noise"
            print(f"service on {url}{noise}", flush=True)
            await run_demo(client, args.question or DEMO_QUESTIONS, args.k, args.max_tokens)

    asyncio.run(main())
    return 0


def _add_asset_options(parser: argparse.ArgumentParser, engine: bool = True) -> None:
    parser.add_argument("--model", help="any Hugging Face model directory (default: the embedded model)")
    parser.add_argument("--corpus", help="JSONL corpus of {id, title, text} (default: the embedded corpus)")
    if engine:
        parser.add_argument(
            "--eager", action="store_true", help="skip graph compilation (faster start, slower prefill)"
        )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prepare = subparsers.add_parser("prepare", help="build whatever is missing: corpus, model, store, index")
    _add_asset_options(prepare, engine=False)
    prepare.set_defaults(handler=_prepare)

    serve = subparsers.add_parser("serve", help="serve the RAG and OpenAI-compatible HTTP API")
    _add_asset_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8080, help="port (0: any free port)")
    serve.add_argument("--mode", choices=MODE_NAMES, default="all", help="default optimisation mode")
    serve.add_argument("--api-token-env", metavar="VAR", help="require the bearer token held in $VAR")
    serve.add_argument(
        "--max-prefill-bs", type=int, help="prefill pool size (default: from the token budget)"
    )
    serve.add_argument(
        "--stages",
        type=int,
        help="search stages (speculation points) (default: by index kind, "
        + ", ".join(f"{stages} for {kind.upper()}" for kind, stages in DEFAULT_STAGES.items())
        + ")",
    )
    serve.add_argument(
        "--stage-schedule",
        choices=SCHEDULES,
        default=DEFAULT_STAGE_SCHEDULE,
        help="how the stages cut the search: equal slices, or geometric (1/32, 1/16, 1/8, 1/4, 1/2, "
        "1 of it for 6 stages: the first speculation starts early) (default: %(default)s)",
    )
    serve.add_argument(
        "--speculation",
        choices=SPECULATION_SETTINGS,
        default=ControllerConfig().speculation,
        help="speculative prefill on a running top-k: auto launches one (or a system-prompt warm-up) "
        "only when its expected gain, from measured figures, exceeds its expected cost; always "
        "whenever the prefill pool has room; never (default: %(default)s; see docs/speculation.md)",
    )
    serve.add_argument(
        "--engine-url",
        action="append",
        metavar="URL",
        help="an OpenAI-compatible engine server to use instead of the in-process vLLM; "
        "repeat it to pool several servers behind the router",
    )
    serve.add_argument(
        "--engine-kv-events",
        action="append",
        metavar="tcp://HOST:PORT",
        help="mirror the --engine-url server's prefix cache through the KV events it publishes there "
        "(replay on PORT+1, topic kv: what `specrag engine --kv-events-port PORT` starts); "
        "with several servers, one per --engine-url, in the same order",
    )
    scale = serve.add_argument_group("scale-out (Ray: pip install 'specrag[ray]')")
    scale.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run the engines as Ray actors: on the cluster at ADDRESS, else a local Ray instance",
    )
    scale.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engine replicas: in-process vLLM engines, one per core (Ray actors with --ray)",
    )
    scale.add_argument(
        "--router",
        choices=ROUTERS,
        default="specrag",
        help="how prompts are placed on several engines (default: %(default)s)",
    )
    cores = serve.add_argument_group(
        "cores (speculative prefill overlaps the search only if each has its own; see README, Pipelining)"
    )
    cores.add_argument(
        "--engine-cpus",
        metavar="CORES",
        help="every thread of the in-process engine on these cores, e.g. 0 or 0-1 (default: vLLM's choice)",
    )
    cores.add_argument(
        "--search-cpus",
        metavar="CORES",
        help="this process (event loop, vector search) on these cores, apart from --engine-cpus",
    )
    limits = serve.add_argument_group("limits (beyond them: 429 with Retry-After, or 504)")
    limits.add_argument(
        "--max-queries",
        type=int,
        default=DEFAULT_MAX_QUERIES,
        help="queries in flight, all clients (default %(default)s)",
    )
    limits.add_argument(
        "--max-queries-per-client",
        type=int,
        default=DEFAULT_MAX_QUERIES_PER_CLIENT,
        help="queries in flight from one client address (default %(default)s)",
    )
    limits.add_argument(
        "--max-queue",
        type=int,
        default=ControllerConfig().max_queue,
        help="final prompts waiting for the engine's prefill pool (default %(default)s)",
    )
    limits.add_argument(
        "--first-token-timeout",
        type=float,
        default=ControllerConfig().first_token_timeout_s,
        metavar="SECONDS",
        help="no first token by then: 504 (after one retry on a fresh engine) (default %(default)s)",
    )
    serve.set_defaults(handler=_serve)

    demo = subparsers.add_parser("demo", help="answer real questions through the full service")
    _add_asset_options(demo)
    demo.add_argument(
        "-q", "--question", action="append", help="a question (repeatable; default: three built in)"
    )
    demo.add_argument("-k", type=int, default=10, help=f"passages per prompt (1..{MAX_K})")
    demo.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per answer")
    demo.set_defaults(handler=_demo)
