"""Exceptions every entry point maps to a clear message (CLI exit 2, HTTP 4xx, typed Python error).

Top-level leaf module: every package raises these, none of them imports anything of ours.
"""

from __future__ import annotations

import contextlib
import enum
from typing import TypeVar

__all__ = [
    "ECHO_LIMIT",
    "REPORTED",
    "ArtifactError",
    "ConflictError",
    "DatabaseUnavailableError",
    "EmbedderError",
    "EmbedderTimeoutError",
    "EngineError",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "InvalidInputError",
    "NotFoundError",
    "OverloadedError",
    "ShardUnavailableError",
    "SpecragError",
    "TooLargeError",
    "WritesSuspendedError",
    "check_choice",
    "echo",
    "failure_report",
    "values",
]

Choice = TypeVar("Choice", bound=enum.StrEnum)


class SpecragError(Exception):
    """Base class of the errors specrag raises on purpose, as opposed to bugs."""


class InvalidInputError(SpecragError, ValueError):
    """The caller asked for something malformed or out of range; retrying the same call fails again."""


class TooLargeError(InvalidInputError):
    """Well formed, but more than the service takes at once (HTTP 413); smaller parts succeed."""


class ArtifactError(SpecragError):
    """A file or directory specrag generated is missing, truncated, corrupt or from another build."""


class EngineError(SpecragError):
    """The inference engine failed, died or timed out; the request may succeed if retried later."""


class EngineUnavailableError(EngineError):
    """No engine is serving right now (starting, recovering after a crash, or shut down)."""


class EngineTimeoutError(EngineError):
    """The engine produced no token within the deadline (hung or overloaded)."""


class NotFoundError(SpecragError, LookupError):
    """The caller named something that does not exist (an unknown or expired session)."""


class ConflictError(SpecragError):
    """What the caller named is busy (a session with a turn in progress); retry when it is done."""


class OverloadedError(SpecragError):
    """The service is at its admission limit; the caller should retry after a pause."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class WritesSuspendedError(SpecragError):
    """The corpus takes no writes until it has replayed a change it could not apply (HTTP 503);
    searches go on, and the write succeeds once the replay is done."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ShardUnavailableError(SpecragError):
    """A shard of a sharded index did not answer in time (dead, restarting or unreachable): the
    search fails naming it (HTTP 503) rather than return a top-k without its rows."""


class DatabaseUnavailableError(SpecragError):
    """The database an index lives in did not answer in time, failed or refused a statement
    (HTTP 503 ``database_unavailable``, Retry-After): retry later. The message names the server
    (never the password) for the log and the command line; an HTTP client is told only that the
    database is unavailable."""


class EmbedderError(EngineError):
    """An embedding server failed or answered malformed data (an upstream failure: HTTP 503
    ``embedding_unavailable`` when it happens to a question)."""


class EmbedderTimeoutError(EmbedderError):
    """An embedding server did not answer within its bound (HTTP 504 ``embedding_timeout``)."""


ECHO_LIMIT = 80
# The errors a command reports in one line (failure_report), as opposed to a bug's traceback.
REPORTED = (SpecragError, OSError, KeyboardInterrupt)


def failure_report(command: str, error: SpecragError | OSError | KeyboardInterrupt) -> tuple[str, int]:
    """The line ``specrag COMMAND`` prints for ``error`` (one of :data:`REPORTED`, the others are
    bugs and get their traceback) and its exit status: 2, what the user can act on (an OSError: a
    data dir that is a file, an unknown host), or 130, interrupted."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted", 130
    return f"specrag {command}: error: {error}", 2


def echo(value: object, limit: int = ECHO_LIMIT) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters.

    Messages quote what the caller sent so the mistake is visible, but a 10,000-character session
    id or a 4,000-digit number must not come back whole (nor fill a log line).
    """
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** (limit + 1):
        # Before repr: it is quadratic in the digits, and Python refuses beyond 4,300 of them.
        return f"an integer of more than {limit} digits"
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text):,} characters)"


def check_choice(what: str, value: object, choices: type[Choice]) -> Choice:
    """``value`` as a member of ``choices``, else :class:`InvalidInputError` naming them.

    The one check of every closed setting (modes, document KV, speculation, ordering policies,
    routers, prefill orders, stage schedules): each is a :class:`enum.StrEnum` whose values are the
    spellings users write, so JSON, the command line and Python accept the same strings. ``what``
    names the setting as the user wrote it (a JSON field, a flag).
    """
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return choices(value)
    names = ", ".join(choice.value for choice in choices)
    raise InvalidInputError(f"unknown {what} {echo(value)}; choose one of {names}")


def values(choices: type[enum.StrEnum]) -> tuple[str, ...]:
    """The spellings of a closed setting, in definition order (a command line's ``choices``)."""
    return tuple(choice.value for choice in choices)
