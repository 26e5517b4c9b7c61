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
