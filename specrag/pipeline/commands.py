"""``specrag make-model`` (write the generated random model) and ``specrag engine`` (start vLLM's
OpenAI server with the settings specrag relies on)."""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import replace
from pathlib import Path

from specrag.errors import InvalidInputError, values
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.models.catalog import DEFAULT_MODEL_NAME, MODEL_NAMES
from specrag.pipeline.models.random_model import (
    RANDOM_MODEL_NAME,
    ModelSize,
    RandomModelSpec,
    is_current_random_model,
    make_random_model,
)
from specrag.retrieval.corpus import build_default_corpus, load_passages

__all__ = ["add_kv_cache_tokens", "engine_server_config", "register"]


def _make_model(args: argparse.Namespace) -> int:
    layout = DataLayout(resolve_data_dir(args.data_dir))
    output = Path(args.output) if args.output else layout.named_model_dir(RANDOM_MODEL_NAME)
    base = (
        RandomModelSpec.for_this_machine()
        if args.size == ModelSize.AUTO
        else RandomModelSpec.sized(args.size)
    )
    spec = replace(base, seed=args.seed)
    if not args.force and is_current_random_model(output, spec):
        print(f"{output} already holds the random model (use --force to rebuild)")
        return 0
    corpus = load_passages(layout.corpus_file) if layout.corpus_file.is_file() else build_default_corpus()
    make_random_model(output, (passage.text for passage in corpus), spec)
    print(
        f"wrote the random model ({spec.num_hidden_layers} layers, hidden {spec.hidden_size}, "
        f"{spec.dtype}) to {output}"
    )
    return 0


def engine_server_config(
    model: str,
    eager: bool,
    kv_events_port: int | None,
    kv_events_host: str = "127.0.0.1",
    kv_cache_tokens: int | None = None,
) -> EngineConfig:
    """The engine config of a separate vLLM server; KV events over TCP when a port is given.

    The publisher binds ``tcp://KV_EVENTS_HOST:PORT`` (events) and ``PORT+1`` (replay): loopback
    unless told otherwise, whatever address the server itself listens on, because the events
    carry every prompt's and answer's token ids; specrag subscribes with
    ``serve --engine-kv-events tcp://HOST:PORT``.
    """
    config = EngineConfig(model=model, enforce_eager=eager, kv_cache_tokens=kv_cache_tokens)
    if kv_events_port is None:
        return config.validate()
    if not 1 <= kv_events_port <= 65534:
        raise InvalidInputError(f"--kv-events-port must be between 1 and 65534, got {kv_events_port}")
    return config.with_tcp_kv_events(kv_events_host, kv_events_port)


def add_kv_cache_tokens(parser: argparse.ArgumentParser) -> None:
    """``--kv-cache-tokens N`` of ``specrag engine`` and ``specrag serve``."""
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        metavar="N",
        help="bound the engine's prefix cache to N tokens (at least one longest prompt); a smaller "
        "cache evicts sooner (default: as many as its memory holds)",
    )


def _engine(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise InvalidInputError(f"--port must be between 0 and 65535, got {args.port}")
    layout = DataLayout(resolve_data_dir(args.data_dir))
    model = str(layout.named_model_dir(args.model)) if args.model in MODEL_NAMES else args.model
    if not os.path.isdir(model):
        raise InvalidInputError(f"no model in {model}: run `specrag prepare` first, or give --model DIR")
    config = engine_server_config(
        model, args.eager, args.kv_events_port, args.kv_events_host, args.kv_cache_tokens
    )
    from vllm.platforms import current_platform  # only here: importing vLLM takes seconds

    command, environment = config.server_command(args.host, args.port, on_cpu=current_platform.is_cpu())
    if args.print:
        assignments = [f"{name}={shlex.quote(value)}" for name, value in environment.items()]
        print(" ".join([*assignments, *map(shlex.quote, command)]))
        return 0
    print(f"starting vLLM's OpenAI server on http://{args.host}:{args.port} …", flush=True)
    os.execve(command[0], command, {**os.environ, **environment})


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    make_model = subparsers.add_parser(
        "make-model",
        help="write the random model (random Llama weights, corpus-trained BPE tokenizer; no download)",
    )
    make_model.add_argument(
        "--output", help=f"model directory (default: DATA_DIR/models/{RANDOM_MODEL_NAME})"
    )
    make_model.add_argument("--seed", type=int, default=RandomModelSpec.seed, help="weight seed")
    make_model.add_argument(
        "--size",
        choices=values(ModelSize),
        default=ModelSize.AUTO,
        help="auto (default): large where the CPU has native bfloat16, else small; "
        "`specrag prepare` and `serve` always use auto",
    )
    make_model.add_argument("--force", action="store_true", help="rebuild even if an identical model exists")
    make_model.set_defaults(handler=_make_model)

    engine = subparsers.add_parser(
        "engine",
        help="start vLLM's OpenAI server with specrag's engine settings (for serve --engine-url)",
    )
    engine.add_argument(
        "--model",
        default=DEFAULT_MODEL_NAME,
        help=f"a model name ({', '.join(MODEL_NAMES)}; `specrag prepare --model NAME` makes it) or any "
        "Hugging Face model directory (default: %(default)s)",
    )
    engine.add_argument("--host", default="127.0.0.1", help="address to bind")
    engine.add_argument("--port", type=int, default=8000, help="port")
    engine.add_argument(
        "--kv-events-port",
        type=int,
        help="publish KV-cache events on tcp://KV_EVENTS_HOST:PORT (replay on PORT+1) so specrag "
        "mirrors the cache",
    )
    engine.add_argument(
        "--kv-events-host",
        default="127.0.0.1",
        help="address the KV-event publisher binds (default %(default)s; the events carry every "
        "prompt's token ids: 0.0.0.0 only for a subscriber on another machine)",
    )
    engine.add_argument("--eager", action="store_true", help="skip graph compilation (faster start)")
    add_kv_cache_tokens(engine)
    engine.add_argument("--print", action="store_true", help="print the command instead of running it")
    engine.set_defaults(handler=_engine)
