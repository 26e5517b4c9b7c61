"""Malformed HTTP requests and the exact 4xx each must get: one table for the tests and bench.faults.

``tests/bench/test_bad_input_catalogue.py`` (and the soak test) send every row to a service on the test
engine and ``python -m bench.faults`` sends them to the real default service, so both check the
same contract: bad input is a precise client error with a JSON body, never a 500, never a hang,
and nothing of it reaches the engine. The rows only assume the service's defaults (``k`` at most
50, a 1 MiB body limit, questions of at most 4,000 characters, a model that cannot hold 50
passages) and a bearer token, which the caller passes to :func:`send`.

Why the table lives here: dependencies between the two trees point one way, tests → bench (the
tests also check ``bench.e2e`` and ``bench.retrieval.search``), never bench → tests, so a benchmark runs from
a checkout without the test suite or pytest. It is not product code either, so it stays out of
``specrag``. The command-line and Python-call rows of the catalogue stay in the test module: only
the tests drive those entry points.

Rows with ``wire`` bytes go over a raw socket: malformed HTTP that a client library refuses to
send, and requests that stop half-way, which the service must end at its read timeouts (the
header timeout closes the connection: status 0; the body timeout answers 408).
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

QUESTION = "What does the assert statement do?"
USER = [{"role": "user", "content": QUESTION}]
JSON_TYPE = {"Content-Type": "application/json"}
# Larger than the service's default 1 MiB body limit.
HUGE_BODY = json.dumps({"query": "x" * (2 << 20)}).encode()
# Far below the limit, yet deep enough to exhaust a recursive JSON parser.
NESTED_BODY = b"[" * 100_000 + b"]" * 100_000
# Small on the wire, past the 1 MiB limit once decoded.
GZIP_BOMB = gzip.compress(b" " * (2 << 20))
# Longer than any request line a server reads (aiohttp: 8190 bytes).
LONG_PATH = "/v1/" + "a" * 9000


@dataclass(frozen=True)
class BadRequest:
    """One malformed request: what is sent, and the status and message fragment it must get.

    ``body`` is sent as JSON unless ``raw`` is given; ``auth`` False leaves the token out, a
    string replaces the whole Authorization header. ``wire``, when given, is the whole request as
    sent on a raw socket (``{token}`` is replaced by the token); status 0 means "the connection is
    closed without an answer".
    """

    name: str
    path: str
    status: int
    message: str
    body: Any = None
    raw: bytes | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    method: str = "POST"
    auth: bool | str = True
    wire: bytes | None = None


def _rag(name: str, body: Any, status: int, message: str) -> BadRequest:
    return BadRequest(name, "/v1/rag", status, message, body=body)


def _chat(name: str, body: Any, status: int, message: str) -> BadRequest:
    return BadRequest(name, "/v1/chat/completions", status, message, body=body)


def _raw(
    name: str, raw: bytes, status: int, message: str, headers: Mapping[str, str] = JSON_TYPE
) -> BadRequest:
    return BadRequest(name, "/v1/rag", status, message, raw=raw, headers=headers)


def _field(name: str, field_name: str, value: Any, message: str) -> BadRequest:
    """A chat request whose one extra field is rejected with a 400."""
    return _chat(name, {"messages": USER, field_name: value}, 400, message)


def _wire(name: str, wire: bytes, status: int, message: str) -> BadRequest:
    return BadRequest(name, "", status, message, wire=wire)


def _post_head(length: int, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/rag HTTP/1.1\r\nHost: specrag\r\nAuthorization: Bearer {token}\r\n"
        b"Content-Type: application/json\r\n" + extra + b"Content-Length: %d\r\n\r\n" % length
    )


def _encoded(name: str, raw: bytes, encoding: str, status: int, message: str) -> BadRequest:
    return _raw(name, raw, status, message, {**JSON_TYPE, "Content-Encoding": encoding})


K_RANGE = "k must be an integer between 1 and 50"

BAD_REQUESTS: tuple[BadRequest, ...] = (
    _raw("empty body", b"", 400, "not valid JSON"),
    _raw("truncated JSON", b'{"query": ', 400, "not valid JSON"),
    _raw("non-UTF-8 body", b'{"query": "\xff\xfe\xfd"}', 400, "not valid JSON"),
    _raw("deeply nested JSON", NESTED_BODY, 400, "nested too deeply"),
    _raw("JSON null", b"null", 400, "must be a JSON object"),
    _raw("huge body", HUGE_BODY, 413, "Maximum request body size"),
    _raw("text/plain body", b'{"query": "hi"}', 415, "Content-Type", {"Content-Type": "text/plain"}),
    _raw(
        "form body", b"query=hi", 415, "Content-Type", {"Content-Type": "application/x-www-form-urlencoded"}
    ),
    _rag("missing query", {"k": 3}, 400, "'query' is required"),
    _rag("empty query", {"query": ""}, 400, "the question is empty"),
    _rag("query is a list", {"query": [QUESTION]}, 400, "'query' must be a string, got list"),
    _rag("lone surrogate in query", {"query": "\ud800 assert"}, 400, "not valid Unicode"),
    _rag("query over 4000 characters", {"query": "word " * 1000}, 400, "longer than 4000 characters"),
    _rag("k negative", {"query": QUESTION, "k": -1}, 400, K_RANGE),
    _rag("k huge", {"query": QUESTION, "k": 10**6}, 400, K_RANGE),
    _rag("k is false", {"query": QUESTION, "k": False}, 400, "'k' must be an integer, got bool"),
    _rag("k is a list", {"query": QUESTION, "k": [3]}, 400, "'k' must be an integer, got list"),
    _rag("empty mode", {"query": QUESTION, "mode": ""}, 400, "unknown mode ''"),
    _rag("mode is a number", {"query": QUESTION, "mode": 3}, 400, "'mode' must be a string"),
    _rag("max_tokens huge", {"query": QUESTION, "max_tokens": 10**20}, 400, "max_tokens must be between"),
    _rag("max_tokens negative", {"query": QUESTION, "max_tokens": -5}, 400, "max_tokens must be between"),
    _rag("stream is a string", {"query": QUESTION, "stream": "true"}, 400, "'stream' must be a boolean"),
    _rag("unknown field", {"query": QUESTION, "temperature": 0.2}, 400, "unknown fields: temperature"),
    _rag("unknown session", {"query": QUESTION, "session_id": "no-such"}, 404, "unknown session 'no-such'"),
    _rag(
        "session id is a number", {"query": QUESTION, "session_id": 7}, 400, "'session_id' must be a string"
    ),
    _rag(
        "prompt over the model limit, streamed",
        {"query": QUESTION, "k": 50, "mode": "serial", "stream": True},
        400,
        "exceeds the model's limit",
    ),
    _chat(
        "chat content is null",
        {"messages": [{"role": "user", "content": None}]},
        400,
        "must be a string or a list",
    ),
    _chat(
        "chat content is an image",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        400,
        "must be a string or a list of text parts",
    ),
    _chat("chat message is a string", {"messages": ["hi"]}, 400, "must be an object with a string 'role'"),
    _chat("chat streamed with k 0", {"messages": USER, "k": 0, "stream": True}, 400, K_RANGE),
    _chat(
        "chat lone surrogate",
        {"messages": [{"role": "user", "content": "\udfff"}]},
        400,
        "not valid Unicode",
    ),
    BadRequest("missing token", "/v1/rag", 401, "bearer token", body={"query": QUESTION}, auth=False),
    BadRequest("wrong token", "/v1/rag", 401, "bearer token", body={"query": QUESTION}, auth="Bearer nope"),
    BadRequest("basic auth", "/v1/sessions", 401, "bearer token", auth="Basic dXNlcjpwdw=="),
    BadRequest("close an unknown session", "/v1/sessions/nope", 404, "unknown session", method="DELETE"),
    BadRequest("unknown route", "/v1/completions", 404, "Not Found", method="POST"),
    BadRequest("wrong method", "/v1/rag", 405, "Method Not Allowed", method="PUT"),
    # Issue 17: JSON that is valid but unusable, or not JSON at all.
    _raw("NaN", b'{"query": "hi", "k": NaN}', 400, "NaN is not a JSON number"),
    _raw("-Infinity", b'{"query": "hi", "k": -Infinity}', 400, "-Infinity is not a JSON number"),
    _raw("float overflow", b'{"query": "hi", "k": 1e999}', 400, "too large for a float"),
    _raw("5,000-digit integer", b'{"query": "hi", "k": %s}' % (b"7" * 5000), 400, "integer of 5,000 digits"),
    _rag("4,000-digit k", {"query": QUESTION, "k": 10**3999}, 400, "integer of 4,000 digits"),
    _rag(
        "10,000-character session id",
        {"query": QUESTION, "session_id": "s" * 10_000},
        404,
        "… (10,002 characters) (never created",
    ),
    _rag("10,000-character field name", {"query": QUESTION, "f" * 10_000: 1}, 400, "(10,002 characters)"),
    # Content-Encoding: decoded by the service, bounded, a bad one is the client's error.
    _encoded("gzip body that does not decode", b'{"query": "hi"}', "gzip", 400, "does not decode as gzip"),
    _encoded("deflate body that does not decode", b"\x00\x01", "deflate", 400, "does not decode as deflate"),
    _encoded("truncated gzip body", gzip.compress(b'{"query": 1}')[:-4], "gzip", 400, "ends before its gzip"),
    _encoded("gzip bomb", GZIP_BOMB, "gzip", 413, "exceeded once decoded from gzip"),
    _encoded("brotli body", b'{"query": "hi"}', "br", 415, "Content-Encoding 'br' is not supported"),
    # OpenAI fields: validated like OpenAI, 400 for what is not supported.
    _field("chat stop is a number", "stop", 5, "'stop' must be a string or a list"),
    _field("chat stop of 5 strings", "stop", list("abcde"), "at most 4 strings"),
    _field("chat stop empty", "stop", [""], "each stop string must have 1 to"),
    _field("chat stop list of numbers", "stop", [1], "stop must be a string or a list"),
    _field("chat n 2", "n", 2, "'n' is not supported: only 1"),
    _field("chat n is a string", "n", "2", "'n' must be an integer, got str"),
    _field("chat logprobs", "logprobs", True, "'logprobs' is not supported"),
    _field("chat temperature 5", "temperature", 5, "temperature must be between 0 and 2"),
    _field("chat temperature -1", "temperature", -1, "temperature must be between"),
    _field("chat temperature hot", "temperature", "hot", "'temperature' must be a number"),
    _field("chat top_p 7", "top_p", 7, "top_p must be greater than 0 and at most 1"),
    _field("chat top_p 0", "top_p", 0, "top_p must be greater than 0"),
    _field("chat seed negative", "seed", -1, "seed must be an integer between 0"),
    _field("chat seed is a float", "seed", 1.5, "'seed' must be an integer, got float"),
    _field("chat presence penalty 3", "presence_penalty", 3, "presence_penalty must be between -2 and 2"),
    _field("chat frequency penalty hot", "frequency_penalty", "hot", "'frequency_penalty' must be a number"),
    _field("chat repetition penalty 0", "repetition_penalty", 0, "repetition_penalty must be greater than 0"),
    _field("chat tools", "tools", [], "'tools' is not supported"),
    _field("chat json schema", "response_format", {"type": "json_schema"}, "'response_format' is not"),
    _field("chat model is a number", "model", 4, "'model' must be a string, got int"),
    _field("chat include_usage yes", "stream_options", {"include_usage": "yes"}, "'include_usage' must"),
    _field("chat stream_options unknown", "stream_options", {"x": 1}, "unsupported stream_options: x"),
    _field("chat unknown field null", "frobnicate", None, "unsupported fields: frobnicate"),
    _chat(
        "chat max_tokens abc beside max_completion_tokens",
        {"messages": USER, "max_completion_tokens": 8, "max_tokens": "abc"},
        400,
        "'max_tokens' must be an integer, got str",
    ),
    BadRequest("unknown model", "/v1/models/gpt-4o", 404, "unknown model 'gpt-4o'", method="GET"),
    # What an HTTP client library would not send. aiohttp's parser answers these itself, in plain
    # text (specrag.service.http.wire); only its log line is specrag's.
    _wire(
        "bad chunk size",
        b"POST /v1/rag HTTP/1.1\r\nHost: specrag\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        400,
        "Invalid character in chunk size",
    ),
    _wire(
        "duplicate Content-Length",
        b"POST /v1/rag HTTP/1.1\r\nHost: specrag\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
        400,
        "Duplicate Content-Length",
    ),
    _wire(
        "duplicate Host",
        b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        400,
        "Duplicate 'Host' header",
    ),
    _wire(
        "over-long URL",
        b"GET " + LONG_PATH.encode() + b" HTTP/1.1\r\nHost: specrag\r\n\r\n",
        400,
        "more than 8190 bytes",
    ),
    _wire("unknown method", b"FOO /v1/rag HTTP/1.1\r\nHost: specrag\r\n\r\n", 400, "Invalid method"),
    # Refused at once, not after the body timeout: nobody should wait for 10 GB that will be refused.
    _wire(
        "10 GB announced, 1 byte sent",
        _post_head(10_000_000_000) + b"{",
        413,
        "exceeded: Content-Length is 10000000000",
    ),
    _wire("half-sent headers", b"POST /v1/rag HTTP/1.1\r\nHost: specrag\r\n", 0, ""),
    _wire("body short of its Content-Length", _post_head(100) + b'{"query": ', 408, "did not arrive within"),
)


async def send(http: aiohttp.ClientSession, base_url: str, row: BadRequest, token: str) -> tuple[int, str]:
    """Send one row; the status and the JSON error message (the raw text if it is not JSON).

    ``http`` must carry no default Authorization header: the rows about tokens choose their own.
    """
    if row.wire is not None:
        return await send_wire(base_url, row.wire.replace(b"{token}", token.encode()))
    headers = dict(row.headers)
    if row.auth is True:
        headers["Authorization"] = f"Bearer {token}"
    elif isinstance(row.auth, str):
        headers["Authorization"] = row.auth
    data = row.raw if row.raw is not None else None if row.body is None else json.dumps(row.body).encode()
    if row.raw is None and row.body is not None:
        headers.setdefault("Content-Type", "application/json")
    async with http.request(row.method, base_url + row.path, data=data, headers=headers) as response:
        text = await response.text()
    try:
        return response.status, str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.status, text


async def send_wire(base_url: str, request: bytes, within_s: float = 90.0) -> tuple[int, str]:
    """Send raw bytes and read one response: its status and JSON error message (or raw text).

    Status 0 when the service closes the connection without answering. ``within_s`` bounds the
    whole exchange, past the service's own read timeouts (30 s by default): a hang fails here.
    """
    url = urlsplit(base_url)
    async with asyncio.timeout(within_s):
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        try:
            writer.write(request)
            await writer.drain()
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return 0, ""
            lines = head.decode("latin-1").split("\r\n")
            sizes = [int(line[15:]) for line in lines if line.lower().startswith("content-length:")]
            text = (await reader.readexactly(sizes[0] if sizes else 0)).decode("utf-8", "replace")
        finally:
            writer.close()
    status = int(lines[0].split()[1])
    try:
        return status, str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return status, text
