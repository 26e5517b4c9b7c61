"""Malformed HTTP requests and the exact 4xx each must get: one table for the tests and bench.faults.

``tests/test_bad_input_catalogue.py`` (and the soak test) send every row to a service on the test
engine and ``python -m bench.faults`` sends them to the real default service, so both check the
same contract: bad input is a precise client error with a JSON body, never a 500, never a hang,
and nothing of it reaches the engine. The rows only assume the service's defaults (``k`` at most
50, a 1 MiB body limit, questions of at most 4,000 characters, a model that cannot hold 50
passages) and a bearer token, which the caller passes to :func:`send`.

Why the table lives here: dependencies between the two trees point one way, tests → bench (the
tests also check ``bench.e2e`` and ``bench.search``), never bench → tests, so a benchmark runs from
a checkout without the test suite or pytest. It is not product code either, so it stays out of
``specrag``. The command-line and Python-call rows of the catalogue stay in the test module: only
the tests drive those entry points.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

QUESTION = "What does the assert statement do?"
USER = [{"role": "user", "content": QUESTION}]
JSON_TYPE = {"Content-Type": "application/json"}
# Larger than the service's default 1 MiB body limit.
HUGE_BODY = json.dumps({"query": "x" * (2 << 20)}).encode()
# Far below the limit, yet deep enough to exhaust a recursive JSON parser.
NESTED_BODY = b"[" * 100_000 + b"]" * 100_000


@dataclass(frozen=True)
class BadRequest:
    """One malformed request: what is sent, and the status and message fragment it must get.

    ``body`` is sent as JSON unless ``raw`` is given; ``auth`` False leaves the token out, a
    string replaces the whole Authorization header.
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


def _rag(name: str, body: Any, status: int, message: str) -> BadRequest:
    return BadRequest(name, "/v1/rag", status, message, body=body)


def _chat(name: str, body: Any, status: int, message: str) -> BadRequest:
    return BadRequest(name, "/v1/chat/completions", status, message, body=body)


def _raw(
    name: str, raw: bytes, status: int, message: str, headers: Mapping[str, str] = JSON_TYPE
) -> BadRequest:
    return BadRequest(name, "/v1/rag", status, message, raw=raw, headers=headers)


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
)


async def send(http: aiohttp.ClientSession, base_url: str, row: BadRequest, token: str) -> tuple[int, str]:
    """Send one row; the status and the JSON error message (the raw text if it is not JSON).

    ``http`` must carry no default Authorization header: the rows about tokens choose their own.
    """
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
