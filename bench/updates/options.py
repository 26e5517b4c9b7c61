"""bench.updates' command-line options."""

from __future__ import annotations

import argparse

DESCRIPTION = (
    "A corpus that changes while it serves: update throughput, search latency under updates, recall."
)


def parse_args() -> argparse.Namespace:
    """bench.updates' options from the command line, defaults resolved (``--quick`` sets its own)."""
    parser = argparse.ArgumentParser(prog="python -m bench.updates", description=DESCRIPTION)
    parser.add_argument("--quick", action="store_true", help="100,000 passages, 200 queries, 2 rounds")
    parser.add_argument(
        "--passages", type=int, help="documents in the corpus (default: 100,000 quick, 300,000)"
    )
    parser.add_argument("--dim", type=int, default=128, help="vector dimensions")
    parser.add_argument("--clusters", type=int, default=1024, help="Gaussian mixture clusters")
    parser.add_argument("--queries", type=int, help="queries a round (default: 200 quick, 500)")
    parser.add_argument("--rounds", type=int, help="idle and updating rounds each (default: 2 quick, 4)")
    parser.add_argument("--rate", type=float, default=50.0, help="updates a second during updating rounds")
    parser.add_argument("--singles", type=int, default=500, help="replacements timed one at a time")
    parser.add_argument("--batch", type=int, default=500, help="documents a batch for the batched figure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--history-only", action="store_true", help="measure only the history: log bytes, RSS, start-up"
    )
    args = parser.parse_args()
    args.passages = args.passages or (100_000 if args.quick else 300_000)
    args.queries = args.queries or (200 if args.quick else 500)
    args.rounds = args.rounds or (2 if args.quick else 4)
    if args.passages < 1000 or args.dim < 2 or args.rate <= 0 or args.batch < 1 or args.singles < 1:
        parser.error("--passages >= 1000, --dim >= 2, --rate > 0, --batch and --singles >= 1")
    return args
