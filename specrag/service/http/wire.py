"""The service's side of the wire: bounded, strict reading of requests, and the error shape.

aiohttp parses HTTP; this module decides what a malformed or slow request gets, so that every
client mistake is a 4xx (in the API's JSON shape once aiohttp has parsed the request) and none is
logged as the service's error:

- Bodies are decoded here, not by aiohttp (``auto_decompress`` off): a gzip or deflate body that
  does not decode is a 400, one that decodes past the body limit a 413, another encoding a 415.
- Reads are bounded in time: request headers not complete within the header timeout (also the
  idle keep-alive time) close the connection; a body that does not arrive in time is a 408.
- JSON is read strictly: ``NaN``/``Infinity`` are not JSON numbers, a number too large for a float
  and an integer of more than 100 digits are named as such (Python refuses to convert an integer
  of more than 4,300 digits, which would otherwise read as "not valid JSON").
- A declared ``Content-Length`` past the body limit is a 413 at once, before any of the body is
  read; the connection then closes rather than drain a body nobody will read.
- What aiohttp's HTTP parser rejects (bad chunk size, duplicate header, over-long line, unknown
  method) never reaches the application: aiohttp answers it, 400 in plain text. Only its log is
  ours, through the documented ``logger`` handler argument: one line at INFO instead of
  aiohttp's traceback at ERROR. Everything here goes through aiohttp's public API (application
  settings, ``handler_args``, middlewares), so an upgrade cannot silently bypass it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import zlib
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http import HttpProcessingError

from specrag.errors import (
    ECHO_LIMIT,
    ArtifactError,
    ConflictError,
    DatabaseUnavailableError,
    EmbedderError,
    EmbedderTimeoutError,
    EngineError,
    EngineTimeoutError,
    EngineUnavailableError,
    InvalidInputError,
    NotFoundError,
    OverloadedError,
    ShardUnavailableError,
    TooLargeError,
    WritesSuspendedError,
    echo,
)

__all__ = [
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_HEADER_TIMEOUT_S",
    "ENGINE_RETRY_AFTER_S",
    "MAX_JSON_INTEGER_DIGITS",
    "BodyLimits",
    "ErrorInfo",
    "describe_error",
    "handler_args",
    "parse_json_object",
    "read_body",
    "read_json_object",
]

logger = logging.getLogger(__name__)

# Longer than aiohttp's client keep-alive (15 s), so an idle client never reuses a closed connection.
DEFAULT_HEADER_TIMEOUT_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 30.0
MAX_JSON_INTEGER_DIGITS = 100
# How long a caller should wait before retrying while the engine restarts.
ENGINE_RETRY_AFTER_S = 5.0
# Content-Encoding -> zlib window bits: gzip's header, or zlib's (RFC 9110 "deflate").
_BODY_DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


@dataclass(frozen=True)
class ErrorInfo:
    """An error as the API reports it."""

    status: int
    message: str
    type: str
    code: str
    retry_after_s: float | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}

    def response(self) -> web.Response:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return web.json_response(self.body(), status=self.status, headers=headers)


def describe_error(error: BaseException) -> ErrorInfo:
    """The status, message and type an exception is reported with; unexpected ones are logged."""
    if isinstance(error, TooLargeError):
        return ErrorInfo(413, str(error), "invalid_request_error", "too_large")
    if isinstance(error, InvalidInputError):
        return ErrorInfo(400, str(error), "invalid_request_error", "invalid_input")
    if isinstance(error, NotFoundError):
        return ErrorInfo(404, str(error), "not_found_error", "not_found")
    if isinstance(error, ConflictError):
        return ErrorInfo(409, str(error), "conflict_error", "conflict")
    if isinstance(error, OverloadedError):
        return ErrorInfo(429, str(error), "overloaded_error", "overloaded", error.retry_after_s)
    if isinstance(error, WritesSuspendedError):
        return ErrorInfo(503, str(error), "writes_suspended", "writes_suspended", error.retry_after_s)
    if isinstance(error, DatabaseUnavailableError):
        # The message names the server (host, database, user) and what it said: the log's, not
        # any client's.
        logger.warning("a request failed on the database: %s", error)
        return ErrorInfo(
            503,
            "the database is unavailable; retry later",
            "database_unavailable",
            "database_unavailable",
            ENGINE_RETRY_AFTER_S,
        )
    if isinstance(error, ShardUnavailableError):
        return ErrorInfo(503, str(error), "search_unavailable", "shard_unavailable", ENGINE_RETRY_AFTER_S)
    if isinstance(error, EmbedderTimeoutError):
        return ErrorInfo(504, str(error), "embedding_timeout", "embedding_timeout")
    if isinstance(error, EmbedderError):  # the question's embedding server, not the engine
        return ErrorInfo(
            503, str(error), "embedding_unavailable", "embedding_unavailable", ENGINE_RETRY_AFTER_S
        )
    if isinstance(error, EngineUnavailableError):
        return ErrorInfo(503, str(error), "engine_unavailable", "engine_unavailable", ENGINE_RETRY_AFTER_S)
    if isinstance(error, EngineTimeoutError):
        return ErrorInfo(504, str(error), "engine_timeout", "engine_timeout")
    if isinstance(error, EngineError):
        return ErrorInfo(502, str(error), "engine_error", "engine_failed")
    if isinstance(error, ArtifactError):
        # A damaged store row or index file: the operator must act (the log names the file and the
        # command); the caller learns only that this answer cannot be given from intact data.
        logger.error("refused to answer from a damaged artefact: %s", error)
        return ErrorInfo(
            503,
            "a file the answer needs is damaged; the service log says which",
            "artifact_error",
            "artifact_damaged",
        )
    if isinstance(error, web.HTTPException):
        code = error.reason.lower().replace(" ", "_")
        kind = "not_found_error" if error.status == 404 else "invalid_request_error"
        return ErrorInfo(error.status, error.text or error.reason, kind, code)
    logger.error("unexpected error while serving a request", exc_info=error)
    return ErrorInfo(500, "internal server error", "internal_error", "internal_error")


@dataclass(frozen=True)
class BodyLimits:
    """How large a request body may be (decoded) and how long it may take to arrive."""

    max_bytes: int
    timeout_s: float


async def read_body(request: web.Request, limits: BodyLimits) -> bytes:
    """The body, decoded, within the time and size limits (408, 413, 415 or 400 otherwise)."""
    declared = request.content_length
    if declared is not None and declared > limits.max_bytes:  # refused before waiting for any of it
        raise web.HTTPRequestEntityTooLarge(
            max_size=limits.max_bytes,
            actual_size=declared,
            text=f"Maximum request body size {limits.max_bytes} exceeded: Content-Length is {declared}",
        )
    try:
        async with asyncio.timeout(limits.timeout_s):
            raw = await request.read()  # raises 413 past the application's client_max_size
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the body did not arrive within {limits.timeout_s:g} s") from None
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in _BODY_DECODERS:
        raise web.HTTPUnsupportedMediaType(
            text=f"Content-Encoding {echo(encoding)} is not supported: use gzip, deflate or none"
        )
    decoder = zlib.decompressobj(_BODY_DECODERS[encoding])
    try:
        body = decoder.decompress(raw, limits.max_bytes + 1)
    except zlib.error as error:
        raise InvalidInputError(f"the body does not decode as {encoding}: {error}") from None
    if len(body) > limits.max_bytes:
        raise web.HTTPRequestEntityTooLarge(
            max_size=limits.max_bytes,
            actual_size=len(body),
            text=f"Maximum request body size {limits.max_bytes} exceeded once decoded from {encoding}",
        )
    if not decoder.eof:
        raise InvalidInputError(f"the body ends before its {encoding} stream does")
    return body


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_JSON_INTEGER_DIGITS:
        raise InvalidInputError(
            f"the body holds an integer of {digits:,} digits; "
            f"no field takes more than {MAX_JSON_INTEGER_DIGITS}"
        )
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise InvalidInputError(f"the body holds a number too large for a float: {echo(text, 40)}")
    return value


def _no_constant(name: str) -> Any:
    raise InvalidInputError(f"the body is not valid JSON: {name} is not a JSON number")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or :class:`InvalidInputError` saying what is wrong with it."""
    try:
        body = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_no_constant)
    except InvalidInputError:
        raise  # valid JSON, or nearly, with something precise to say about it
    except json.JSONDecodeError as error:
        raise InvalidInputError(
            f"the body is not valid JSON ({error.msg}: line {error.lineno}, column {error.colno})"
        ) from None
    except ValueError:
        raise InvalidInputError("the body is not valid JSON") from None
    except RecursionError:  # a small body of nested brackets exhausts the parser's stack
        raise InvalidInputError("the body is nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidInputError("the body must be a JSON object")
    return body


async def read_json_object(request: web.Request, limits: BodyLimits) -> dict[str, Any]:
    """A request's body as a JSON object: 415 unless it says it is JSON, then read and parsed by
    the rules above (every endpoint with a body reads it here)."""
    if request.content_type != "application/json":
        raise web.HTTPUnsupportedMediaType(text="the body must be JSON (Content-Type: application/json)")
    return parse_json_object(await read_body(request, limits))


def handler_args(header_timeout_s: float) -> dict[str, Any]:
    """aiohttp's per-connection settings for these reading rules; given to the application
    (``Application(handler_args=...)``), so they hold whatever runs it. All three are documented
    keyword arguments of aiohttp's request handler."""
    return {"auto_decompress": False, "keepalive_timeout": header_timeout_s, "logger": HTTP_LOG}


class _MalformedRequests(logging.Filter):
    """One INFO line, not an ERROR with a traceback, for a request aiohttp's HTTP parser rejects:
    the client's mistake, not the service's. aiohttp logs those to its handler's ``logger``
    (:data:`HTTP_LOG` here) with the parser's exception; anything else passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError) and 400 <= (error.code or 400) < 500:
            detail = (error.message or "bad request").strip().splitlines()[0].rstrip(":")
            record.msg, record.args = (
                "malformed HTTP request from %s: %s",
                (
                    record.args[0] if isinstance(record.args, tuple) and record.args else "?",
                    detail if len(detail) <= ECHO_LIMIT else detail[:ECHO_LIMIT] + "…",
                ),
            )
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


HTTP_LOG = logging.getLogger("specrag.service.http")
HTTP_LOG.addFilter(_MalformedRequests())
