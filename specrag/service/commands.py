"""The command lines of ``specrag prepare``, ``serve``, ``demo`` and ``batch``.

What each command does once its line is parsed is :mod:`specrag.service.handlers`'.
"""

from __future__ import annotations

import argparse

from specrag.controller.controller import ControllerConfig
from specrag.controller.modes import ModeName
from specrag.controller.placement import Router
from specrag.controller.speculation_policy import SpeculationSetting
from specrag.errors import values
from specrag.pipeline.commands import add_kv_cache_tokens
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.models.catalog import DEFAULT_MODEL_NAME, MODEL_NAMES
from specrag.retrieval.stages import DEFAULT_SCHEDULE, DEFAULT_STAGES, Schedule
from specrag.service.handlers import (
    MAX_BATCH,
    MAX_K,
    batch_command,
    demo_command,
    prepare_command,
    serve_command,
)
from specrag.service.options import DocumentKvStore, ServiceOptions
from specrag.service.server import (
    DEFAULT_MAX_QUERIES,
    DEFAULT_MAX_QUERIES_PER_CLIENT,
    SHUTDOWN_GRACE_S,
)

__all__ = ["register"]


def _add_asset_options(parser: argparse.ArgumentParser, engine: bool = True) -> None:
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
    _add_document_kv_bound(prepare)
    prepare.set_defaults(handler=prepare_command)


def _register_serve(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``specrag serve``: the service, its engines and its limits."""
    serve = subparsers.add_parser("serve", help="serve the RAG and OpenAI-compatible HTTP API")
    _add_asset_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8080, help="port (0: any free port)")
    serve.add_argument(
        "--mode",
        choices=values(ModeName),
        default=ControllerConfig().mode,
        help="default optimisation mode",
    )
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
    _add_client_options(serve)
    _add_query_options(serve)
    _add_engine_options(serve)
    _add_core_options(serve)
    _add_limit_options(serve)
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
        choices=values(Schedule),
        default=DEFAULT_SCHEDULE,
        help="how the stages cut the search: equal slices, or geometric (1/32, 1/16, 1/8, 1/4, 1/2, "
        "1 of it for 6 stages: the first speculation starts early) (default: %(default)s)",
    )
    serve.add_argument(
        "--speculation",
        choices=values(SpeculationSetting),
        default=ControllerConfig().speculation,
        help="speculative prefill on a running top-k: auto launches one (or a system-prompt warm-up) "
        "only when its expected gain, from measured figures, exceeds its expected cost; always "
        "whenever the prefill pool has room; never (default: %(default)s; see docs/speculation.md)",
    )
    serve.add_argument(
        "--order-hint",
        action=argparse.BooleanOptionalAction,
        default=ControllerConfig().order_hint,
        help="when ordering for the prefix cache changed the documents' order, tell the model their "
        "retrieval ranking (RAGBoost's order hint); off by default: it cost the default model "
        "accuracy (docs/quality.md)",
    )


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
        "--max-queue",
        type=int,
        default=ControllerConfig().max_queue,
        help="final prompts waiting for the engine's prefill pool (default %(default)s)",
    )
    limits.add_argument(
        "--shutdown-timeout",
        type=float,
        default=SHUTDOWN_GRACE_S,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, answers in flight have this long to finish before they are "
        "aborted (default %(default)s)",
    )
    limits.add_argument(
        "--first-token-timeout",
        type=float,
        default=ControllerConfig().first_token_timeout_s,
        metavar="SECONDS",
        help="no first token this long after the prompt went to the engine: 504; retried only on another "
        "or a restarted engine, never on the same working one (default %(default)s)",
    )
    limits.add_argument(
        "--inter-token-timeout",
        type=float,
        default=ControllerConfig().inter_token_timeout_s,
        metavar="SECONDS",
        help="no next token of an answer by then: the stream moves to another replica or a "
        "recovered engine, or ends with an error event (default %(default)s)",
    )


def _register_demo(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``specrag demo``: questions through the full service."""
    demo = subparsers.add_parser("demo", help="answer real questions through the full service")
    _add_asset_options(demo)
    demo.add_argument(
        "-q", "--question", action="append", help="a question (repeatable; default: three built in)"
    )
    demo.add_argument(
        "-k", type=int, default=5, help=f"passages per prompt (1..{MAX_K}) (default: %(default)s)"
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
        "--batch-size", type=int, default=MAX_BATCH, help=f"questions per batch (1..{MAX_BATCH})"
    )
    batch.add_argument("-k", type=int, help=f"passages per prompt (1..{MAX_K}; default: the service's)")
    batch.add_argument("--mode", choices=values(ModeName), help="optimisation mode (default: the service's)")
    batch.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per answer")
    batch.set_defaults(handler=batch_command)
