"""What ``specrag prepare``, ``serve``, ``demo`` and ``batch`` do once their command line is parsed
(:mod:`specrag.service.cli.parser`): build the embedded default, serve it, query it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from specrag.client import AsyncClient
from specrag.controller.config import ControllerConfig, serve_flags
from specrag.controller.modes import DocumentKv, DocumentKvVariant
from specrag.controller.tiers import document_kv_sampling
from specrag.errors import InvalidInputError, check_choice
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.protocol import Sampling
from specrag.pipeline.models.random_model import RANDOM_MODEL_NAME
from specrag.retrieval.backends.registry import Chosen, chosen
from specrag.service.cli.demo import DEMO_QUESTIONS, run_demo
from specrag.service.cli.engine_log import engine_output_to
from specrag.service.http.access import Access
from specrag.service.http.app import serving
from specrag.service.http.auth import check_tokens
from specrag.service.run.assembly import (
    Service,
    ServiceOptions,
    open_service,
    prompt_builder,
)
from specrag.service.run.assets import (
    Assets,
    CheckingAssets,
    check_assets_in_background,
    ensure_assets,
)
from specrag.service.run.exposure import warn_if_exposed
from specrag.service.run.imports import import_for_start, start_imports
from specrag.service.run.lifecycle import run_serving, serve_until_signalled
from specrag.service.run.options import DocumentKvStore, base_engine_config
from specrag.service.run.startup import Phase, StartupProgress, bind_listener, parse_bounds

__all__ = [
    "answer_file",
    "batch_command",
    "demo_command",
    "prepare_command",
    "serve_command",
    "token_from_env",
]


def _paths(args: argparse.Namespace) -> tuple[DataLayout, str | None, Path | None]:
    layout = DataLayout(resolve_data_dir(args.data_dir))
    return layout, args.model, Path(args.corpus) if args.corpus else None


def _assets(
    args: argparse.Namespace,
    serving: bool = False,
    on_model: Callable[[Path], None] | None = None,
    backend: Chosen[Any] | None = None,
) -> Assets:
    """The assets the flags name; ``serving``: an index embedded by another embedder than
    ``--embedder`` is refused (the questions would be embedded unlike it), not rebuilt. The
    retrieval backend is ``backend`` when the command chose it already, else the one the flags
    choose (:func:`~specrag.retrieval.backends.registry.chosen`), which opens the index (shards
    searched by Ray actors are loaded by them alone: this process keeps their manifests).
    ``on_model`` is :func:`ensure_assets`'s."""
    return ensure_assets(
        *_paths(args),
        accept_corpus_change=args.accept_corpus_change,
        backend=backend or chosen(args),
        refuse_other_embedder=serving,
        on_model=on_model,
    )


def prepare_command(args: argparse.Namespace) -> int:
    assets = _assets(args)
    print(
        f"ready in {_paths(args)[0].root}: {len(assets.passages)} passages, model {assets.model_dir}, "
        f"store {assets.store.path.name} ({assets.store.info.total_tokens} tokens), "
        f"index {assets.index.searcher.ntotal} rows × {assets.index.dim} dims"
    )
    if args.document_kv:
        kv_dir = _paths(args)[0].document_kv_dir
        print(f"computing every passage's KV into {kv_dir} (TurboRAG; minutes)…", flush=True)
        variant = check_choice("--document-kv-variant", args.document_kv_variant, DocumentKvVariant)
        filled = asyncio.run(_fill_document_kv(assets, kv_dir, args.document_kv_max_gib, variant))
        print(f"document KV ready: {filled} segments computed, the others were stored already")
    return 0


async def _fill_document_kv(assets: Assets, kv_dir: Path, max_gib: float, variant: DocumentKvVariant) -> int:
    """Start the in-process engine with the store and fill it with the system prompt and every
    passage, each computed alone or after the system prompt (``variant``)."""
    from specrag.pipeline.engines.vllm_engine import VllmEngine

    options = ServiceOptions(document_kv_dir=str(kv_dir), document_kv_max_gib=max_gib)
    config = base_engine_config(assets.model_dir, options).validate()
    engine = await VllmEngine.start(config)
    try:
        layout = prompt_builder(assets, engine).build_with_question_tokens(range(len(assets.store)), [])
        after_system = variant is DocumentKvVariant.AFTER_SYSTEM
        sampling = document_kv_sampling(Sampling(), layout, 0, after_system=after_system)
        return await engine.fill_prompt_kv(layout.token_ids, sampling)
    finally:
        await engine.close()


@contextlib.asynccontextmanager
async def _service(
    args: argparse.Namespace,
    assets: Assets | CheckingAssets,
    options: ServiceOptions,
    quiet: bool = False,
    progress: StartupProgress | None = None,
) -> AsyncIterator[Service]:
    """The supervised engine(s), the controller and the application over them
    (:mod:`specrag.service.run.assembly`).

    The run directory (the in-process engines' KV-event sockets) is this process's alone: it goes
    when the service stops. ``quiet`` says what starts on standard error (standard output is data).
    """
    print(_starting(assets, options), file=sys.stderr if quiet else sys.stdout, flush=True)
    run_dir = _paths(args)[0].root / "run" / f"serve-{os.getpid()}"
    progress = progress or StartupProgress()
    try:
        progress.begin(Phase.ENGINE_LOAD, _engine_waits_for(assets, options))
        async with open_service(assets, options, run_dir) as service:
            progress.end(Phase.ENGINE_LOAD)
            yield service
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def _engine_log(args: argparse.Namespace, quiet: bool = False) -> Iterator[None]:
    """Unless ``-v``: vLLM's and the libraries' output into ``DATA_DIR/run/COMMAND-PID.log``, the
    terminal left to specrag's own lines (:mod:`specrag.service.cli.engine_log`); the first line
    says where it went, on standard error when ``quiet`` (standard output is data)."""
    if args.verbose:
        yield
        return
    log_file = _paths(args)[0].root / "run" / f"{args.command}-{os.getpid()}.log"
    print(
        f"engine and library logs: {log_file} (-v shows them here)",
        file=sys.stderr if quiet else sys.stdout,
        flush=True,
    )
    with engine_output_to(log_file):
        yield


def _starting(assets: Assets | CheckingAssets, options: ServiceOptions) -> str:
    """What the service is about to start or connect to, said before the minute it may take."""
    if options.ray_address is not None:
        where = options.ray_address or "a local Ray instance"
        return f"starting {options.replicas} vLLM replicas on {where}…"
    if options.engine_urls:
        return f"connecting to the engine server(s) at {', '.join(options.engine_urls)}…"
    engines = f"{options.replicas} vLLM engines, one per core," if options.pooled else "vLLM"
    return f"starting {engines} on {assets.model_dir}…"


def _engine_waits_for(assets: Assets | CheckingAssets, options: ServiceOptions) -> str:
    """What the engine's load waits for, said should it outlive its bound."""
    if options.ray_address is not None:
        shards = f" and {options.search_shards} search shards" if options.search_shards else ""
        where = options.ray_address or "a local Ray instance"
        return f"Ray to place and start {options.replicas} vLLM replicas{shards} on {where}"
    if options.engine_urls:
        return f"the engine server(s) at {', '.join(options.engine_urls)} to answer"
    engines = f"{options.replicas} in-process vLLM engines" if options.pooled else "vLLM"
    return (
        f"{engines} to start on {assets.model_dir} (its processes, the weights, graph compilation "
        "or its cache, warm-up runs; `-v` shows vLLM's own lines)"
    )


def token_from_env(variable: str | None) -> str | None:
    """The token from an environment variable: on the command line it would show in ``ps``."""
    if variable is None:
        return None
    token = os.environ.get(variable)
    if not token:
        raise InvalidInputError(f"--api-token-env: environment variable {variable} is not set or empty")
    return token


def _api_tokens(path: str | None, flag: str = "--api-tokens-file") -> tuple[str, ...]:
    """The tokens of ``--api-tokens-file`` (or ``flag``): one a line, one per client (blank lines
    and lines starting with # skipped)."""
    if path is None:
        return ()
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidInputError(f"{flag}: cannot read {path}: {error}") from None
    tokens = tuple(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not tokens:
        raise InvalidInputError(f"{flag}: {path} holds no token")
    check_tokens(tokens, f"{flag}: {path}")
    return tokens


def _access(args: argparse.Namespace) -> Access:
    """Who ``serve`` lets in and how many queries each may have in flight, as the application takes it."""
    token = token_from_env(args.api_token_env)
    tokens = _api_tokens(args.api_tokens_file)
    if token is not None and token in tokens:
        raise InvalidInputError("--api-token-env: that token is also in --api-tokens-file")
    return Access(
        tokens=(*([token] if token is not None else []), *tokens),
        writer_tokens=_api_tokens(args.writer_tokens_file, "--writer-tokens-file"),
        trust_forwarded_for=args.trust_forwarded_for,
        max_queries=args.max_queries,
        max_queries_per_client=args.max_queries_per_client,
    )


def _controller_config(args: argparse.Namespace) -> ControllerConfig:
    """The controller settings ``serve`` was given, each under its field's name
    (:mod:`specrag.service.cli.parser`), its errors naming the flags."""
    flags = serve_flags()
    return ControllerConfig(
        **{setting: getattr(args, setting) for setting in flags},
        document_kv=check_choice("--document-kv", args.document_kv, DocumentKvStore).request_default,
        names={setting: flag.name for setting, flag in flags.items()},
    )


def serve_command(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise InvalidInputError(f"--port must be between 0 and 65535, got {args.port}")
    if not args.shutdown_timeout >= 0:  # written so that NaN fails too
        raise InvalidInputError(f"--shutdown-timeout must be 0 or more seconds, got {args.shutdown_timeout}")
    backend = chosen(args)  # a combination the backend refuses fails before anything is touched
    access = _access(args)
    # Writer tokens alone make every endpoint but /health need a token (docs/updates.md).
    warn_if_exposed(args.host, bool(access.tokens) or bool(access.writer_tokens))
    config = _controller_config(args)
    document_kv = config.document_kv is DocumentKv.TURBO
    options = ServiceOptions(
        controller=config,
        engine_urls=tuple(args.engine_url or ()),
        engine_kv_events=tuple(args.engine_kv_events or ()),
        eager=args.eager,
        access=access,
        ray_address=args.ray,
        replicas=args.replicas,
        search_shards=args.search_shards if backend.backend.sharded else None,  # the lookup decides
        search_shard_cpus=args.search_shard_cpus,
        index_dir=str(_paths(args)[0].index_dir),
        router=args.router,
        engine_cpus=args.engine_cpus,
        search_cpus=args.search_cpus,
        document_kv_dir=str(_paths(args)[0].document_kv_dir) if document_kv else None,
        document_kv_max_gib=args.document_kv_max_gib,
        kv_cache_tokens=args.kv_cache_tokens,
    )

    progress = StartupProgress.since_process_start(parse_bounds(args.startup_timeout or ()))
    imports = start_imports(
        in_process_engine=not options.engine_urls and options.ray_address is None, embedder=args.embedder
    )
    listener = bind_listener(args.host, args.port)  # a busy port fails now, not after the engine's start

    def check(on_model: Callable[[Path], None]) -> Assets:
        """The artefacts, timed: the engine's load overlaps all but the model's verification."""
        progress.begin(Phase.ARTEFACTS)
        assets = _assets(args, True, on_model, backend)
        progress.end(Phase.ARTEFACTS)
        return assets

    @contextlib.asynccontextmanager
    async def start() -> AsyncIterator[Service]:
        # Once, on one thread, before the artefact checks and the engine's start import side by
        # side (specrag.service.run.imports): two threads importing one package can crash.
        progress.begin(Phase.IMPORTS)
        await asyncio.to_thread(import_for_start, imports)
        progress.end(Phase.IMPORTS)
        assets = await check_assets_in_background(check)
        try:
            async with _service(args, assets, options, progress=progress) as service:
                yield service
        finally:
            assets.close()  # after the last query: a table's connections

    with contextlib.closing(listener), _engine_log(args):
        run_serving(
            serve_until_signalled(
                listener,
                progress,
                start,
                shutdown_timeout_s=args.shutdown_timeout,
                announce=lambda line: print(line, flush=True),
            ),
            args.command,
        )
    return 0


def demo_command(args: argparse.Namespace) -> int:
    ControllerConfig().check_k(args.k, "-k")  # the demo's service runs with the default settings
    if args.max_tokens < 1:
        raise InvalidInputError(f"--max-tokens must be at least 1, got {args.max_tokens}")

    async def main() -> None:
        async with (
            _service(args, assets, ServiceOptions(eager=args.eager)) as service,
            serving(service.app, access_log=False) as url,
            AsyncClient(url) as client,
        ):
            noise = "; the random model's answers are noise" if args.model == RANDOM_MODEL_NAME else ""
            print(f"service on {url}{noise}", flush=True)
            await run_demo(client, args.question or DEMO_QUESTIONS, args.k, args.max_tokens)

    with _engine_log(args):
        assets = _assets(args)
        asyncio.run(main())
    return 0


def _questions(path: str) -> list[str]:
    """The file's questions, one per non-blank line (``-``: standard input)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise InvalidInputError(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise InvalidInputError(f"{path} is not UTF-8 text") from None
    questions = [line.strip() for line in text.splitlines() if line.strip()]
    if not questions:
        raise InvalidInputError(f"{path} holds no question (one per line)")
    return questions


async def answer_file(client: AsyncClient, questions: Sequence[str], batch_size: int, **options: Any) -> None:
    """Answer the questions in batches of ``batch_size``: one JSON line per answer, in file order,
    with its batch, the position it ran at in that batch's plan, and its timeline."""
    for number, start in enumerate(range(0, len(questions), batch_size)):
        result = await client.batch(questions[start : start + batch_size], **options)
        ran_at = {question: position for position, question in enumerate(result.plan["order"])}
        for index, (query, answer) in enumerate(zip(result.queries, result.answers, strict=True)):
            line = {
                "query": query,
                "answer": answer.answer,
                "finish_reason": answer.finish_reason,
                "documents": answer.documents,
                "sources": answer.sources,
                "batch": number,
                "ran_at": ran_at[index],
                "specrag": answer.timeline,
            }
            print(json.dumps(line), flush=True)


def batch_command(args: argparse.Namespace) -> int:
    limit = ControllerConfig.max_batch_queries
    if not 1 <= args.batch_size <= limit:
        raise InvalidInputError(f"--batch-size must be between 1 and {limit}, got {args.batch_size}")
    questions = _questions(args.file)
    options: dict[str, Any] = {"max_tokens": args.max_tokens}
    options.update({name: value for name, value in (("k", args.k), ("mode", args.mode)) if value is not None})
    token = token_from_env(args.api_token_env)

    async def main() -> None:
        if args.url is not None:
            async with AsyncClient(args.url, api_token=token) as client:
                await answer_file(client, questions, args.batch_size, **options)
            return
        assets = _assets(args)
        async with (
            _service(args, assets, ServiceOptions(eager=args.eager), quiet=True) as service,
            serving(service.app, access_log=False) as url,
            AsyncClient(url) as client,
        ):
            await answer_file(client, questions, args.batch_size, **options)

    if args.url is not None:
        asyncio.run(main())
        return 0
    with _engine_log(args, quiet=True):  # the engine's output must not reach the JSON lines
        asyncio.run(main())
    return 0
