"""bench.ordering's command-line options."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from bench.ordering.runs import BENCH_POLICIES, CACHES

DESCRIPTION = "Ordering benchmark: prefix reuse of every ordering policy on document-ID traces."


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """bench.ordering's options (``argv``; None: the command line's)."""
    parser = argparse.ArgumentParser(prog="python -m bench.ordering", description=DESCRIPTION)
    parser.add_argument("--trace", type=Path, help="JSONL doc-ID trace; without it, run the full benchmark")
    parser.add_argument("--policy", help=f"with --trace: one of {', '.join(BENCH_POLICIES)}")
    parser.add_argument("--emit", type=Path, help="with --trace: write the requests in execution order here")
    parser.add_argument(
        "--emit-cache",
        choices=CACHES,
        default="lru10",
        help="which run to emit: the tree mirroring the bounded cache (default) or an unlimited one",
    )
    parser.add_argument("--window", default="16", help="window policy: waiting requests (16) or time (250ms)")
    parser.add_argument("--rate", type=float, help="window policy: Poisson arrivals a second")
    parser.add_argument("--quick", action="store_true", help="smaller traces (finishes in about two minutes)")
    return parser.parse_args(argv)
