"""The command lines of ``specrag prepare``, ``serve``, ``demo`` and ``batch``.

What each command does once its line is parsed is :mod:`specrag.service.cli.commands`'.
"""

from __future__ import annotations

import argparse
import enum
import typing
from typing import Any

from specrag.controller.config import ControllerConfig, serve_flags
from specrag.controller.modes import DocumentKvVariant, ModeName
from specrag.controller.placement import Router
from specrag.errors import values
from specrag.pipeline.commands import add_kv_cache_tokens
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.models.catalog import DEFAULT_MODEL_NAME, MODEL_NAMES
from specrag.retrieval.backends.registry import QUERY_EMBEDDERS
from specrag.retrieval.backends.registry import add_arguments as add_backend_arguments
from specrag.retrieval.index_store import EMBEDDER_ENV, MINILM, WORDLLAMA, default_embedder
from specrag.service.cli.commands import (
    batch_command,
    demo_command,
    prepare_command,
    serve_command,
)
from specrag.service.http.access import DEFAULT_MAX_QUERIES, DEFAULT_MAX_QUERIES_PER_CLIENT
from specrag.service.http.app import SHUTDOWN_GRACE_S
from specrag.service.run.options import DocumentKvStore, ServiceOptions
from specrag.service.run.startup import DEFAULT_BOUNDS_S

__all__ = ["register"]


def _add_asset_options(parser: argparse.ArgumentParser, engine: bool = True, embedder: bool = True) -> None:
    """The flags of the commands that prepare the assets (``embedder``: serve's has its own)."""
    if embedder:
        parser.add_argument(
            "--embedder",
            choices=QUERY_EMBEDDERS,
            default=default_embedder(),
            help=f"the index's embedder: an index embedded by another is rebuilt (default: ${EMBEDDER_ENV}, "
            f"else {MINILM}, contextual; {WORDLLAMA}: static, far faster to build, fewer right passages)",
        )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL_NAME,
        help=f"a model name ({', '.join(MODEL_NAMES)}: made offline in the data directory) or any "
        "Hugging Face model directory (default: %(default)s, a real instruction-tuned model; random "
        "has random weights, for experiments that set the prefill cost)",
    )
    parser.add_argument("--corpus", help="JSONL corpus of {id, title, text} (default: the embedded corpus)")
    parser.add_argument(
        "--accept-corpus-change",
        action="store_true",
        help="rebuild the store and index even when the corpus lost passages since they were built "
        "(without it such a corpus is refused; any change is said at WARNING)",
    )
    if engine:
        parser.add_argument(
            "--eager", action="store_true", help="skip graph compilation (faster start, slower decode)"
        )


def _add_document_kv_bound(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--document-kv-max-gib",
        type=float,
        default=EngineConfig.document_kv_max_gib,
        metavar="GIB",
        help="the document KV store's size bound; least recently used entries go (default %(default)s)",
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Each command's parser, in the order `specrag --help` shows them."""
    _register_prepare(subparsers)
    _register_serve(subparsers)
    _register_demo(subparsers)
    _register_batch(subparsers)


def _register_prepare(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``specrag prepare``: the assets, and optionally every passage's KV."""
    prepare = subparsers.add_parser("prepare", help="build whatever is missing: corpus, model, store, index")
    _add_asset_options(prepare, engine=False)
    prepare.add_argument(
        "--document-kv",
        action="store_true",
        help="also compute every passage's KV into the document KV store (for serve --document-kv turbo)",
    )
    prepare.add_argument(
        "--document-kv-variant",
        choices=values(DocumentKvVariant),
        default=ControllerConfig.document_kv_variant,
        help="with --document-kv: each passage's KV computed alone or after the system prompt, as "
        "serve's --document-kv-variant will load it (default: %(default)s)",
    )
    _add_document_kv_bound(prepare)
    prepare.set_defaults(handler=prepare_command)


def _register_serve(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``specrag serve``: the service, its engines and its limits."""
    serve = subparsers.add_parser("serve", help="serve the RAG and OpenAI-compatible HTTP API")
    _add_asset_options(serve, embedder=False)  # --embedder: the retrieval backend's group
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8080, help="port (0: any free port)")
    serve.add_argument(
        "--document-kv",
        choices=values(DocumentKvStore),
        default=DocumentKvStore.OFF,
        help="turbo: load documents' stored KV instead of prefilling them (TurboRAG; approximate "
        "without a fine-tuned model, see docs/turbo.md); requests choose with document_kv "
        "(default: %(default)s)",
    )
    _add_document_kv_bound(serve)
    add_kv_cache_tokens(serve)
    add_backend_arguments(serve.add_argument_group("retrieval backend"), building=False)
    _add_client_options(serve)
    _add_query_options(serve)
    _add_engine_options(serve)
    _add_core_options(serve)
    _add_limit_options(serve)
    _add_startup_bounds(serve)
    serve.set_defaults(handler=serve_command)


def _add_client_options(serve: argparse.ArgumentParser) -> None:
    """Who the service lets in and how it tells clients apart."""
    clients = serve.add_argument_group(
        "clients (who the per-client limits count: queries in flight, sessions)"
    )
    clients.add_argument("--api-token-env", metavar="VAR", help="require the bearer token held in $VAR")
    clients.add_argument(
        "--api-tokens-file",
        metavar="FILE",
        help="accept the bearer tokens in FILE, one a line, one per client: the token then tells "
        "clients apart (else the address does)",
    )
    clients.add_argument(
        "--writer-tokens-file",
        metavar="FILE",
        help="bearer tokens, one a line, that may also change documents (/v1/documents); with "
        "tokens configured, no other token may",
    )
    clients.add_argument(
        "--trust-forwarded-for",
        action="store_true",
        help="tell clients apart by the address in X-Forwarded-For (the last one: only behind a "
        "proxy that sets it)",
    )


def _add_query_options(serve: argparse.ArgumentParser) -> None:
    """How each query searches, speculates and builds its prompt."""
    _add_controller_flags(serve, limit=False)


def _add_controller_flags(parser: argparse._ActionsContainer, limit: bool) -> None:
    """The controller settings ``serve`` takes (:func:`~specrag.controller.config.serve_flags`):
    the limits among them (``limit``) or the others, each typed, chosen and defaulted by its field;
    the value lands under the field's name."""
    hints = typing.get_type_hints(ControllerConfig)
    defaults = ControllerConfig()
    for setting, flag in serve_flags().items():
        if flag.limit is not limit:
            continue
        default = getattr(defaults, setting)
        extra: dict[str, Any]
        if isinstance(default, enum.StrEnum):
            extra = {"choices": values(type(default))}
        elif isinstance(default, bool):
            extra = {"action": argparse.BooleanOptionalAction}
        else:  # the metavar the flag's own name gives, as if the value landed under it
            hint = hints[setting]
            (kind,) = [kind for kind in typing.get_args(hint) or (hint,) if kind is not type(None)]
            extra = {"type": kind, "metavar": flag.metavar or flag.name.lstrip("-").replace("-", "_").upper()}
        parser.add_argument(flag.name, dest=setting, default=default, help=flag.help, **extra)


def _add_engine_options(serve: argparse.ArgumentParser) -> None:
    """Where the engines are: separate servers, or Ray replicas."""
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
        "--search-shards",
        type=int,
        metavar="N",
        help="search the index's N shards (specrag index build --shards N) as N Ray actors; needs --ray",
    )
    scale.add_argument(
        "--search-shard-cpus",
        type=float,
        metavar="C",
        help="CPUs each shard actor asks Ray for, a share of a core allowed (default: one each when the "
        "cluster has them beside the engine replicas, else an equal share of what they leave)",
    )
    scale.add_argument(
        "--router",
        choices=values(Router),
        default=ServiceOptions().router,
        help="how prompts are placed on several engines (default: %(default)s)",
    )


def _add_core_options(serve: argparse.ArgumentParser) -> None:
    """Which cores the engine and the search run on."""
    cores = serve.add_argument_group(
        "cores (speculative prefill overlaps the search only if each has its own; see docs/pipelining.md)"
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


def _add_limit_options(serve: argparse.ArgumentParser) -> None:
    """The bounds beyond which a query is turned away."""
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
        help="queries in flight from one client (default %(default)s)",
    )
    limits.add_argument(
        "--shutdown-timeout",
        type=float,
        default=SHUTDOWN_GRACE_S,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, answers in flight have this long to finish before they are "
        "aborted (default %(default)s)",
    )
    _add_controller_flags(limits, limit=True)


def _add_startup_bounds(serve: argparse.ArgumentParser) -> None:
    """How long each phase of the start may take before ``serve`` gives up with an error."""
    defaults = ", ".join(f"{phase.value} {seconds:g}" for phase, seconds in DEFAULT_BOUNDS_S.items())
    serve.add_argument(
        "--startup-timeout",
        action="append",
        metavar="PHASE=SECONDS",
        help="bound a phase of the start (repeatable; defaults: " + defaults + "); past its bound "
        "serve exits with status 2 and an error naming the phase and what it waited for, its "
        "processes stopped",
    )


def _register_demo(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``specrag demo``: questions through the full service."""
    demo = subparsers.add_parser("demo", help="answer real questions through the full service")
    _add_asset_options(demo)
    demo.add_argument(
        "-q", "--question", action="append", help="a question (repeatable; default: three built in)"
    )
    demo.add_argument(
        "-k",
        type=int,
        default=5,
        help=f"passages per prompt (1..{ControllerConfig.k_max}) (default: %(default)s)",
    )
    demo.add_argument(
        "--max-tokens", type=int, default=48, help="tokens to generate per answer (default: %(default)s)"
    )
    demo.set_defaults(handler=demo_command)


def _register_batch(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``specrag batch``: a file of questions, planned for prefix reuse."""
    batch = subparsers.add_parser(
        "batch",
        help="answer a file of questions, one per line, as batches planned for prefix reuse",
        description="Answers every question of FILE (one per line; - for standard input) through "
        "POST /v1/rag/batch: each batch is retrieved, ordered so that its prompts share the longest "
        "prefixes, and answered; prints one JSON line per answer, in file order. Starts the embedded "
        "service unless --url names a running one.",
    )
    _add_asset_options(batch)
    batch.add_argument("file", metavar="FILE", help="questions, one per line (- reads standard input)")
    batch.add_argument("--url", help="a running specrag service (default: start the embedded one)")
    batch.add_argument("--api-token-env", metavar="VAR", help="the service's bearer token is in $VAR")
    batch.add_argument(
        "--batch-size",
        type=int,
        default=ControllerConfig.max_batch_queries,
        help=f"questions per batch (1..{ControllerConfig.max_batch_queries})",
    )
    batch.add_argument(
        "-k", type=int, help=f"passages per prompt (1..{ControllerConfig.k_max}; default: the service's)"
    )
    batch.add_argument("--mode", choices=values(ModeName), help="optimisation mode (default: the service's)")
    batch.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per answer")
    batch.set_defaults(handler=batch_command)
