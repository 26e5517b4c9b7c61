"""Exceptions every entry point maps to a clear message (CLI exit 2, HTTP 4xx, typed Python error).

Top-level leaf module: every package raises these, none of them imports anything of ours.
"""

from __future__ import annotations


class SpecragError(Exception):
    """Base class of the errors specrag raises on purpose, as opposed to bugs."""


class InvalidInputError(SpecragError, ValueError):
    """The caller asked for something malformed or out of range; retrying the same call fails again."""


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


class OverloadedError(SpecragError):
    """The service is at its admission limit; the caller should retry after a pause."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EmbedderError(EngineError):
    """An embedding server failed, timed out or answered malformed data (an upstream failure)."""
