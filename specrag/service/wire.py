"""The service's side of the wire: bounded, strict reading of requests, and the error shape.

aiohttp parses HTTP; this module decides what a malformed or slow request gets, so that every
client mistake is a 4xx in the API's JSON shape and none is logged as the service's error:

- Bodies are decoded here, not by aiohttp (``auto_decompress`` off): a gzip or deflate body that
  does not decode is a 400, one that decodes past the body limit a 413, another encoding a 415.
- Reads are bounded in time: request headers not complete within the header timeout (also the
  idle keep-alive time) close the connection; a body that does not arrive in time is a 408.
- JSON is read strictly: ``NaN``/``Infinity`` are not JSON numbers, a number too large for a float
  and an integer of more than 100 digits are named as such (Python refuses to convert an integer
  of more than 4,300 digits, which would otherwise read as "not valid JSON").
- What aiohttp's HTTP parser rejects (bad chunk size, duplicate header, over-long line, unknown
  method) is answered in the JSON error shape and logged as one line at INFO; aiohttp itself
  answers in plain text and logs a traceback at ERROR.
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
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler

from specrag.errors import ECHO_LIMIT, InvalidInputError, echo

logger = logging.getLogger(__name__)

# Longer than aiohttp's client keep-alive (15 s), so an idle client never reuses a closed connection.
DEFAULT_HEADER_TIMEOUT_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 30.0
MAX_JSON_INTEGER_DIGITS = 100
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


@dataclass(frozen=True)
class BodyLimits:
    """How large a request body may be (decoded) and how long it may take to arrive."""

    max_bytes: int
    timeout_s: float


async def read_body(request: web.Request, limits: BodyLimits) -> bytes:
    """The body, decoded, within the time and size limits (408, 413, 415 or 400 otherwise)."""
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
    except ValueError:
        raise InvalidInputError("the body is not valid JSON") from None
    except RecursionError:  # a small body of nested brackets exhausts the parser's stack
        raise InvalidInputError("the body is nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidInputError("the body must be a JSON object")
    return body


def handler_args(header_timeout_s: float) -> dict[str, Any]:
    """aiohttp's per-connection settings for these reading rules; given to the application
    (``Application(handler_args=...)``), so they hold whatever runs it."""
    return {"auto_decompress": False, "keepalive_timeout": header_timeout_s}


class _ConnectionHandler(RequestHandler):
    """aiohttp's per-connection protocol, answering what its HTTP parser rejects in the API's JSON
    error shape (aiohttp answers in plain text and logs a traceback at ERROR)."""

    __slots__ = ()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:  # an error of ours that escaped the middleware: a bug, logged in full
            logger.error("error while serving a request from %s", request.remote, exc_info=exc)
            info = ErrorInfo(status, "internal server error", "internal_error", "internal_error")
        else:
            if isinstance(exc, LineTooLong):
                detail = "the request line or a header is longer than 8190 bytes"
            else:
                detail = (message or "").strip().splitlines()[0].rstrip(":") if message else "bad request"
            detail = detail if len(detail) <= ECHO_LIMIT else detail[:ECHO_LIMIT] + "…"
            logger.info("malformed HTTP request from %s: %s", request.remote, detail)
            info = ErrorInfo(
                status, f"malformed HTTP request: {detail}", "invalid_request_error", "bad_request"
            )
        if request.writer.output_size > 0:
            raise ConnectionError("the response had already started; the connection is closed instead")
        response = info.response()
        response.force_close()
        return response


class _Server(web.Server):
    """aiohttp's server, with :class:`_ConnectionHandler` connections."""

    def __call__(self) -> RequestHandler:
        return _ConnectionHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorRunner(web.AppRunner):
    """aiohttp's application runner, serving through :class:`_Server`."""

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        return _Server(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            **made._kwargs,
        )
