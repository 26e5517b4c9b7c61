"""``specrag make-model``: write the embedded default model directory."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.default_model import (
    MODEL_SIZES,
    DefaultModelSpec,
    is_current_default_model,
    make_default_model,
)
from specrag.retrieval.corpus import build_default_corpus, load_passages


def _make_model(args: argparse.Namespace) -> int:
    layout = DataLayout(resolve_data_dir(args.data_dir))
    output = Path(args.output) if args.output else layout.model_dir
    base = DefaultModelSpec.for_this_machine() if args.size == "auto" else DefaultModelSpec.sized(args.size)
    spec = replace(base, seed=args.seed)
    if not args.force and is_current_default_model(output, spec):
        print(f"{output} already holds the default model (use --force to rebuild)")
        return 0
    corpus = load_passages(layout.corpus_file) if layout.corpus_file.is_file() else build_default_corpus()
    make_default_model(output, (passage.text for passage in corpus), spec)
    print(
        f"wrote the default model ({spec.num_hidden_layers} layers, hidden {spec.hidden_size}, "
        f"{spec.dtype}) to {output}"
    )
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    make_model = subparsers.add_parser(
        "make-model",
        help="write the default model (random Llama weights, corpus-trained BPE tokenizer; no download)",
    )
    make_model.add_argument("--output", help="model directory (default: DATA_DIR/model)")
    make_model.add_argument("--seed", type=int, default=DefaultModelSpec.seed, help="weight seed")
    make_model.add_argument(
        "--size",
        choices=("auto", *MODEL_SIZES),
        default="auto",
        help="auto (default): large where the CPU has native bfloat16, else small; "
        "`specrag prepare` and `serve` always use auto",
    )
    make_model.add_argument("--force", action="store_true", help="rebuild even if an identical model exists")
    make_model.set_defaults(handler=_make_model)
