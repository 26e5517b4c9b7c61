"""A readable terminal for ``specrag serve`` and ``demo``: their own lines there, the engine's in a file.

Starting vLLM prints a few dozen lines a newcomer cannot act on: vLLM's warnings from each of its
processes, Triton's and torch's warnings, tqdm bars of checkpoint loading, libraries' DEBUG
lines. Most come from the engine-core and worker processes vLLM spawns, which inherit this
process's standard output and error file descriptors, and some from C code; Python's logging
cannot reach them. So for the duration of the command the two descriptors point at a log file,
which every process started within inherits, while ``sys.stdout`` and ``sys.stderr`` (where
specrag prints its own lines, progress bars and errors) keep writing to the terminal. In this
process, specrag's log records (and aiohttp's access log) go to the terminal, every record to the
file; Python warnings become log records; vLLM's logger is left unconfigured by vLLM
(``VLLM_CONFIGURE_LOGGING=0``, its documented switch), so that its records reach the same
handlers here and its processes' warnings their standard error, the file.

``-v`` leaves everything on the terminal, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

__all__ = ["LOG_FORMAT", "TERMINAL_LOGGERS", "engine_output_to"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Loggers whose records are specrag's own lines on the terminal; the access log is the service's.
TERMINAL_LOGGERS = ("specrag", "aiohttp.access")


class _Ours(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return any(record.name == name or record.name.startswith(f"{name}.") for name in TERMINAL_LOGGERS)


def _terminal_stream(descriptor: int) -> TextIO:
    """A line-buffered text stream on ``descriptor``, which the caller closes."""
    return open(descriptor, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)


@contextlib.contextmanager
def engine_output_to(log_file: Path) -> Iterator[None]:
    """Within the block: descriptors 1 and 2 (and so every process started) append to
    ``log_file``, ``sys.stdout``/``sys.stderr`` stay the terminal, logging as the module says."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    sys.stdout.flush()
    sys.stderr.flush()
    streams, root = (sys.stdout, sys.stderr), logging.getLogger()
    handlers = root.handlers[:]
    terminal = os.dup(1), os.dup(2)
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout, sys.stderr = _terminal_stream(terminal[0]), _terminal_stream(terminal[1])
    on_terminal = logging.StreamHandler(sys.stderr)
    on_terminal.addFilter(_Ours())
    in_file = logging.FileHandler(log_file, encoding="utf-8")
    for handler in (on_terminal, in_file):
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        root.handlers = [on_terminal, in_file]
        logging.captureWarnings(True)
        yield
    finally:
        logging.captureWarnings(False)
        root.handlers = handlers
        in_file.close()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
            stream.close()
        sys.stdout, sys.stderr = streams
        os.dup2(terminal[0], 1)
        os.dup2(terminal[1], 2)
        for descriptor in (*terminal, log):
            os.close(descriptor)
