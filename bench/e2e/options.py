"""bench.e2e's command-line options."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import add_model_option
from bench.traces import WORKLOADS
from specrag.pipeline.models.catalog import DEFAULT_MODEL_NAME

DESCRIPTION = "End-to-end RAG latency: the paper's comparisons on the real engine, in one run."
QUICK_REQUESTS = 8


def parse_args() -> argparse.Namespace:
    """bench.e2e's options from the command line, defaults resolved (``--quick`` sets its own)."""
    parser = argparse.ArgumentParser(prog="python -m bench.e2e", description=DESCRIPTION)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="serial, all and serial again only, 8 requests a trace, a 1M-vector index",
    )
    add_model_option(parser, DEFAULT_MODEL_NAME, "the real model a user runs")
    parser.add_argument("--index-size", type=int, help="vectors in the padded index (default 2M, quick 1M)")
    parser.add_argument("--nlist", type=int, default=1024, help="IVF lists of the padded index")
    parser.add_argument(
        "--ratio", type=float, default=0.5, help="vector search ratio of the main configurations"
    )
    parser.add_argument("-k", type=int, default=6, help="passages per prompt")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per answer")
    parser.add_argument("--requests", type=int, help="queries per configuration (default 32, quick 8)")
    parser.add_argument(
        "--rate", type=float, help="arrivals per second (default: --utilization of the measured capacity)"
    )
    parser.add_argument(
        "--utilization",
        type=float,
        default=0.6,
        help="without --rate: arrivals at this share of one engine's capacity for cold prompts, "
        "1 / (search at --ratio + cold prefill of a typical prompt), both measured at the start",
    )
    parser.add_argument(
        "--cv", type=float, default=1.0, help="inter-arrival coefficient of variation (1 = Poisson)"
    )
    parser.add_argument("--workload", choices=WORKLOADS, default="bursty")
    parser.add_argument(
        "--seeds",
        type=int,
        help="traces for the main configurations, in counterbalanced orders (default 2, also with --quick)",
    )
    parser.add_argument("--trace", type=Path, help="replay this JSONL trace instead of generating one")
    parser.add_argument("--save-trace", type=Path, help="write the generated trace (seed 0) here")
    parser.add_argument("--engine-cpus", default="0", help="core(s) of the engine's model worker")
    parser.add_argument("--search-cpus", default="1", help="core(s) of the vector search thread")
    parser.add_argument("--eager", action="store_true", help="no graph compilation in the engine")
    parser.add_argument(
        "--engine-url",
        help="an OpenAI-compatible server (vLLM with --enable-prompt-tokens-details, SGLang) instead of "
        "the in-process engine; --model must then name its model directory (for the tokenizer)",
    )
    args = parser.parse_args()
    args.rate_given = args.rate
    if args.rate is not None and not args.rate > 0:
        parser.error("--rate must be positive")
    if not 0 < args.utilization < 1:
        parser.error("--utilization must be between 0 and 1")
    args.index_size = args.index_size or (1_000_000 if args.quick else 2_000_000)
    args.requests = args.requests or (QUICK_REQUESTS if args.quick else 32)
    args.seeds = args.seeds or 2
    return args
