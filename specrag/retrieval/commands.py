"""``specrag corpus …`` sub-commands (and, next to them, the index commands)."""

from __future__ import annotations

import argparse
from pathlib import Path

from specrag.paths import DataLayout, resolve_data_dir
from specrag.retrieval.corpus import DEFAULT_PASSAGE_WORDS, build_default_corpus, write_passages


def _corpus_build(args: argparse.Namespace) -> int:
    layout = DataLayout(resolve_data_dir(args.data_dir))
    output = Path(args.output) if args.output else layout.corpus_file
    count = write_passages(output, build_default_corpus(target_words=args.words))
    print(f"wrote {count} passages to {output}")
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    corpus = subparsers.add_parser("corpus", help="build the default corpus")
    corpus_sub = corpus.add_subparsers(dest="corpus_command", metavar="ACTION", required=True)
    build = corpus_sub.add_parser(
        "build", help="write the default corpus (pydoc topics + stdlib docstrings) as JSONL passages"
    )
    build.add_argument("--output", help="JSONL file to write (default: DATA_DIR/corpus/passages.jsonl)")
    build.add_argument("--words", type=int, default=DEFAULT_PASSAGE_WORDS, help="target words per passage")
    build.set_defaults(handler=_corpus_build)
