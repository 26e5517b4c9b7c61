"""The ``specrag`` console command.

Each package contributes its own sub-commands through a ``register(subparsers)`` function in its
``commands`` module, so a newcomer finds a command next to the code it drives.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from specrag import __version__
from specrag.errors import SpecragError

# Order here is the order shown by ``specrag --help``.
COMMAND_MODULES = (
    "specrag.retrieval.commands",
    "specrag.pipeline.commands",
    "specrag.service.commands",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specrag", description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--version", action="version", version=f"specrag {__version__}")
    parser.add_argument(
        "--data-dir",
        default=None,
        help="where generated artefacts live (default: $SPECRAG_DATA_DIR or ./data)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.verbose:
        # vLLM logs every start-up step at INFO; keep the commands' own output readable.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        result: int = args.handler(args)
    except SpecragError as error:
        print(f"specrag {args.command}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a data dir that is a file, an unwritable path, an unknown host
        print(f"specrag {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return result


if __name__ == "__main__":
    sys.exit(main())
