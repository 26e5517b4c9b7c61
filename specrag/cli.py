"""The ``specrag`` console command.

Each package contributes its own sub-commands through a ``register(subparsers)`` function in its
``commands`` module (the service's in ``service/cli/parser.py`` and
``service/cli/document_commands.py``), so a newcomer finds a command next to the code it drives.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from specrag import __version__
from specrag.errors import REPORTED, failure_report

__all__ = ["COMMAND_MODULES", "build_parser", "main"]

# Order here is the order shown by ``specrag --help``.
COMMAND_MODULES = (
    "specrag.retrieval.commands",
    "specrag.pipeline.commands",
    "specrag.service.cli.parser",
    "specrag.service.cli.document_commands",
)


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default in ``--help`` (unless it has none or the help text names it),
    in plain text: the reStructuredText literals of docstrings used as descriptions lose their
    double backticks."""

    def format_help(self) -> str:
        return super().format_help().replace("``", "")

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or "default:" in text
            or default in (None, False, argparse.SUPPRESS)
            or not action.option_strings
        ):
            return action.help
        return f"{text} (default: %(default)s)"


def _add_global_options(parser: argparse.ArgumentParser, top_level: bool) -> None:
    """``--data-dir`` and ``-v``, accepted before and after the sub-command.

    On sub-commands their default is SUPPRESS, so a value given before the sub-command is not
    overwritten by the sub-command's default.
    """
    parser.add_argument(
        "--data-dir",
        default=None if top_level else argparse.SUPPRESS,
        help="where generated artefacts live (default: $SPECRAG_DATA_DIR or ./data)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=False if top_level else argparse.SUPPRESS,
        help="log at DEBUG level",
    )


def _sub_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every sub-command's parser below this one, nested ones included."""
    found: list[argparse.ArgumentParser] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                found.extend([child, *_sub_parsers(child)])
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specrag",
        description=__doc__.splitlines()[0] if __doc__ else "",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"specrag {__version__}")
    _add_global_options(parser, top_level=True)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    for child in _sub_parsers(parser):
        child.formatter_class = _HelpFormatter
        _add_global_options(child, top_level=False)
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
    except REPORTED as error:
        line, status = failure_report(args.command, error)
        print(line, file=sys.stderr)
        return status
    return result


if __name__ == "__main__":
    sys.exit(main())
