"""bench.pipeline's command-line options, shared by the sweep and the points run alone."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from bench.common import add_model_option
from bench.pipeline.calibration import QUICK_TARGET_RATIOS, TARGET_RATIOS
from specrag.pipeline.models.random_model import RANDOM_MODEL_NAME
from specrag.retrieval.backends.pgvector.flags import add_stage_arguments
from specrag.retrieval.search.stages import DEFAULT_STAGES

__all__ = ["DESCRIPTION", "SWEEP_KINDS", "parse_args"]

DESCRIPTION = "Where speculative pipelining pays: TTFT against the search-to-prefill ratio r = S / P."
# IVF kinds (index_store.KINDS) the sweep can run on.
SWEEP_KINDS = ("ivf-sq8", "ivf", "ivf-pq")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """bench.pipeline's options (``argv``; None: the command line's), defaults resolved."""
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=DESCRIPTION)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer queries, an 8M-vector index, and of the idle sweep only its low-r point and r near 1",
    )
    add_model_option(
        parser, RANDOM_MODEL_NAME, "its size is set per machine so that search and prefill can cost the same"
    )
    parser.add_argument(
        "--kind", choices=SWEEP_KINDS, default="ivf-sq8", help="IVF kind of the sweep's index (lists' codes)"
    )
    parser.add_argument(
        "--index-size", type=int, help="vectors in the sweep's padded IVF index (default 12M, quick 8M)"
    )
    parser.add_argument("--nlist", type=int, default=1024, help="IVF lists of the padded indexes")
    parser.add_argument(
        "--flat-size",
        type=int,
        default=4_000_000,
        help="vectors in the padded flat IVF index of the extra point at r near 1 (0: none)",
    )
    parser.add_argument(
        "--hnsw-size", type=int, default=200_000, help="vectors in the padded HNSW index (0: no HNSW point)"
    )
    parser.add_argument(
        "--targets",
        type=lambda text: tuple(float(value) for value in text.split(",")),
        help="search-to-prefill ratios of the idle sweep, comma-separated "
        f"(default: {','.join(map(str, TARGET_RATIOS))}; quick {','.join(map(str, QUICK_TARGET_RATIOS))})",
    )
    parser.add_argument(
        "--idle-queries", type=int, help="queries per idle configuration (default 32, quick 16)"
    )
    parser.add_argument(
        "--loaded-queries", type=int, help="queries per loaded configuration (default 48, quick 20)"
    )
    parser.add_argument(
        "--utilization", type=float, default=0.7, help="loaded arrival rate / saturation rate"
    )
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per answer")
    parser.add_argument(
        "--stages",
        type=int,
        help="stages per search in the speculating configurations (default: the index kind's, "
        + ", ".join(f"{stages} for {kind.upper()}" for kind, stages in DEFAULT_STAGES.items())
        + ")",
    )
    parser.add_argument(
        "--pgvector-rows",
        type=int,
        default=0,
        help="rows of the padded pgvector table of the extra point at r near 1 (0: none; "
        "bench.pipeline.pgvector_point alone: 300,000)",
    )
    add_stage_arguments(parser)
    parser.add_argument("--engine-cpus", default="0", help="core(s) of the engine's model worker")
    parser.add_argument("--search-cpus", default="1", help="core(s) of the vector search thread")
    parser.add_argument("--eager", action="store_true", help="no graph compilation in the engine")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.index_size = args.index_size or (8_000_000 if args.quick else 12_000_000)
    args.targets = args.targets or (QUICK_TARGET_RATIOS if args.quick else TARGET_RATIOS)
    args.idle_queries = args.idle_queries or (16 if args.quick else 32)
    args.loaded_queries = args.loaded_queries or (20 if args.quick else 48)
    if not 0 < args.utilization < 1:
        parser.error("--utilization must be between 0 and 1")
    return args
