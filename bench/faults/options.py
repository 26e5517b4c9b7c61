"""bench.faults' command-line options."""

from __future__ import annotations

import argparse

DESCRIPTION = "Reliability of the real service under faults, overload, disconnects and bad input."


def parse_args() -> argparse.Namespace:
    """bench.faults' options from the command line; ``--quick`` sets the load's size."""
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=DESCRIPTION)
    parser.add_argument("--quick", action="store_true", help="shorter loads, fewer disconnects")
    parser.add_argument(
        "--soak-s", type=float, help="seconds of soak with disconnects on the real engine (60 quick, 600)"
    )
    args = parser.parse_args()
    args.clients = 3 if args.quick else 6
    args.burst = 12 if args.quick else 32
    args.disconnects = 12 if args.quick else 60
    if args.soak_s is None:
        args.soak_s = 60.0 if args.quick else 600.0
    return args
