"""``specrag prepare`` and ``specrag demo``: build the embedded default and run real queries on it."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from specrag.controller.assets import ensure_assets
from specrag.controller.demo import DEMO_QUESTIONS, run_demo
from specrag.errors import InvalidInputError
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.config import EngineConfig
from specrag.pipeline.vllm_engine import VllmEngine

MAX_K = 64


def _paths(args: argparse.Namespace) -> tuple[DataLayout, Path | None, Path | None]:
    layout = DataLayout(resolve_data_dir(args.data_dir))
    return layout, Path(args.model) if args.model else None, Path(args.corpus) if args.corpus else None


def _prepare(args: argparse.Namespace) -> int:
    layout, model, corpus = _paths(args)
    assets = ensure_assets(layout, model, corpus)
    print(
        f"ready in {layout.root}: {len(assets.passages)} passages, model {assets.model_dir}, "
        f"store {assets.store.path.name} ({assets.store.info.total_tokens} tokens), "
        f"index {assets.index.searcher.ntotal} rows × {assets.index.dim} dims"
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    if not 1 <= args.k <= MAX_K:
        raise InvalidInputError(f"-k must be between 1 and {MAX_K}, got {args.k}")
    if args.max_tokens < 1:
        raise InvalidInputError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    layout, model, corpus = _paths(args)
    assets = ensure_assets(layout, model, corpus)
    config = EngineConfig(model=str(assets.model_dir), enforce_eager=args.eager).validate()

    async def main() -> None:
        print(f"starting vLLM on {assets.model_dir} (about a minute on a small CPU machine)…", flush=True)
        engine = await VllmEngine.start(config)
        try:
            await run_demo(engine, assets, args.question or DEMO_QUESTIONS, args.k, args.max_tokens)
        finally:
            await engine.close()

    asyncio.run(main())
    return 0


def _add_asset_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="any Hugging Face model directory (default: the embedded model)")
    parser.add_argument("--corpus", help="JSONL corpus of {id, title, text} (default: the embedded corpus)")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prepare = subparsers.add_parser("prepare", help="build whatever is missing: corpus, model, store, index")
    _add_asset_options(prepare)
    prepare.set_defaults(handler=_prepare)

    demo = subparsers.add_parser("demo", help="answer real questions with retrieval and the real engine")
    _add_asset_options(demo)
    demo.add_argument(
        "-q", "--question", action="append", help="a question (repeatable; default: three built in)"
    )
    demo.add_argument("-k", type=int, default=10, help=f"passages per prompt (1..{MAX_K})")
    demo.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per answer")
    demo.add_argument(
        "--eager", action="store_true", help="skip graph compilation (faster start, slower prefill)"
    )
    demo.set_defaults(handler=_demo)
