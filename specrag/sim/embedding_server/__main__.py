"""``python -m specrag.sim.embedding_server --port N [--precompute TEXTS.json]``: the embedding
stand-in until interrupted (SIGINT or SIGTERM stop it cleanly). See
:mod:`specrag.sim.embedding_server`."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from specrag.errors import InvalidInputError
from specrag.sim.embedding_server.server import EmbeddingStandIn, EmbeddingStandInSettings
from specrag.sim.signals import run_until_interrupted, stop_on_signals

_DEFAULTS = EmbeddingStandInSettings(port=0)


def _texts(path: str | None, parser: argparse.ArgumentParser) -> tuple[str, ...]:
    if path is None:
        return ()
    try:
        texts = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        parser.error(f"--precompute {path}: {error}")
    if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
        parser.error(f"--precompute {path}: expected a JSON list of strings")
    return tuple(texts)


def parse_settings(argv: list[str] | None = None) -> EmbeddingStandInSettings:
    parser = argparse.ArgumentParser(
        prog="python -m specrag.sim.embedding_server",
        description="A GPU-pace embedding-server stand-in with real MiniLM vectors "
        "(never a model's latency).",
    )
    parser.add_argument("--port", type=int, required=True, help="HTTP port on 127.0.0.1 (0: any free one)")
    parser.add_argument(
        "--model", default=_DEFAULTS.model, help="the served model name (default %(default)s)"
    )
    parser.add_argument(
        "--batch-ms",
        type=float,
        default=_DEFAULTS.batch_s * 1e3,
        help="one batch's time (default %(default)s)",
    )
    parser.add_argument("--max-batch-texts", type=int, default=_DEFAULTS.max_batch_texts)
    parser.add_argument(
        "--precompute", metavar="TEXTS.json", help="a JSON list of texts embedded before it serves"
    )
    args = parser.parse_args(argv)
    try:
        return EmbeddingStandInSettings(
            port=args.port,
            model=args.model,
            batch_s=args.batch_ms / 1e3,
            max_batch_texts=args.max_batch_texts,
            precompute=_texts(args.precompute, parser),
        )
    except InvalidInputError as error:
        parser.error(str(error))


async def serve(settings: EmbeddingStandInSettings) -> None:
    from specrag.retrieval.embedders.minilm_embedder import MiniLMEmbedder

    stop = stop_on_signals()
    embedder = await asyncio.to_thread(MiniLMEmbedder)
    async with EmbeddingStandIn(settings, embedder) as server:
        print(f"embedding stand-in on {server.url} ({len(settings.precompute)} texts embedded)", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    return run_until_interrupted(serve(parse_settings(argv)))


if __name__ == "__main__":
    sys.exit(main())
