"""The async Python client of the specrag service.

One :class:`aiohttp.ClientSession` per client, so a sequence of questions reuses one connection
(the service's latency figures should not include a TCP handshake per question). Imports nothing
of the service side (no vLLM, no controller), so ``specrag.AsyncClient`` is cheap to import.

Errors are typed: an HTTP error becomes :class:`SpecragHTTPError` with the service's status,
message and type; a timeout :class:`SpecragTimeoutError`; an unreachable service
:class:`SpecragConnectionError`. Streams close their connection when left early, which makes the
service abort the query's engine requests.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, Literal, Self, TypeVar, overload
from urllib.parse import quote

import aiohttp

from specrag.errors import SpecragError

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AsyncClient",
    "ChatStream",
    "RagAnswer",
    "RagBatch",
    "RagStream",
    "SpecragConnectionError",
    "SpecragHTTPError",
    "SpecragTimeoutError",
]

DEFAULT_TIMEOUT_S = 300.0
Item = TypeVar("Item")


class SpecragHTTPError(SpecragError):
    """The service answered with an error status (or an error event in a stream)."""

    def __init__(self, status: int, message: str, type: str, code: str | None = None) -> None:
        super().__init__(f"HTTP {status} {type}: {message}")
        self.status = status
        self.message = message
        self.type = type
        self.code = code


class SpecragTimeoutError(SpecragError, TimeoutError):
    """The service sent nothing for ``timeout_s`` seconds."""


class SpecragConnectionError(SpecragError, ConnectionError):
    """The service could not be reached, or the connection broke before the answer was complete."""


@dataclass(frozen=True)
class RagAnswer:
    """A whole answer: the text, the passage IDs it was generated from, and the service's timeline.

    ``sources`` are those passages' ``{"id", "title"}`` in retrieval rank order, for a reader to
    check the answer against.
    """

    answer: str
    finish_reason: str | None
    documents: list[str]
    timeline: dict[str, Any]
    sources: list[dict[str, str]] = field(default_factory=list)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RagAnswer:
        return cls(
            body["answer"],
            body["finish_reason"],
            list(body["documents"]),
            body["specrag"],
            list(body.get("sources", ())),
        )


@dataclass(frozen=True)
class RagBatch:
    """A batch's answers in the order asked, each with its timeline, and the plan they ran by
    (``order``: the questions' indices in the order they ran; ``documents``: each one's passage
    ids in prompt order)."""

    queries: list[str]
    answers: list[RagAnswer]
    plan: dict[str, Any]

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RagBatch:
        answers = body["answers"]
        return cls([a["query"] for a in answers], [RagAnswer.from_json(a) for a in answers], body["plan"])


def _http_error(status: int, body: Any, fallback: str) -> SpecragHTTPError:
    """The typed error for an error body ``{"error": {...}}``, or a generic one for anything else."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return SpecragHTTPError(status, error["message"], str(error.get("type", "error")), error.get("code"))
    return SpecragHTTPError(status, fallback, "error")


async def _raise_for_status(response: aiohttp.ClientResponse) -> None:
    if response.status < 400:
        return
    text = await response.text()
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    raise _http_error(response.status, body, text[:200] or (response.reason or ""))


@contextlib.contextmanager
def _translated(what: str, timeout_s: float) -> Iterator[None]:
    """aiohttp's and asyncio's exceptions as specrag's typed ones."""
    try:
        yield
    except SpecragError:
        raise  # already translated (a nested call)
    except TimeoutError as error:
        raise SpecragTimeoutError(f"{what}: nothing received for {timeout_s:g} s") from error
    except aiohttp.ClientError as error:
        raise SpecragConnectionError(f"{what}: {error}") from error


class _AsyncClosing:
    """``async with`` support for anything with an ``aclose()``."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.aclose()


class _EventStream(_AsyncClosing, Generic[Item]):
    """Server-sent events of one streamed answer: iterate for items, then read the final fields.

    Use as ``async with stream: async for item in stream: ...``; leaving the block (or calling
    :meth:`aclose`) before the end closes the connection, which makes the service abort the query.
    """

    def __init__(self, client: AsyncClient, path: str, body: dict[str, Any]) -> None:
        self._client = client
        self._path = path
        self._body = body
        self._response: aiohttp.ClientResponse | None = None
        self._finished = False
        self.timeline: dict[str, Any] | None = None

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Item:
        try:
            item = None if self._finished else await self._next_item()
        except BaseException:
            await self.aclose()
            raise
        if item is None:
            await self.aclose()
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        """Release the connection; before the end of the answer, close it (the service aborts)."""
        if self._response is not None:
            if self._finished:
                self._response.release()
            else:
                self._response.close()

    async def _next_item(self) -> Item | None:
        """Decode the next event into an item; ``None`` (and ``_finished`` set) at the end."""
        raise NotImplementedError

    async def _event(self) -> tuple[str, str]:
        """The next ``(event name, data)``."""
        what = f"POST {self._path}"
        if self._response is None:
            self._response = await self._client._open("POST", self._path, self._body, streamed=True)
        name, data = "message", list[str]()
        with _translated(what, self._client.timeout_s):
            while True:
                raw = await self._response.content.readline()
                if not raw:
                    raise SpecragConnectionError(f"{what}: the stream ended before the answer was complete")
                line = raw.decode().rstrip("\r\n")
                if not line:
                    if data:
                        return name, "\n".join(data)
                    continue
                field, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if field == "event":
                    name = value
                elif field == "data":
                    data.append(value)


class RagStream(_EventStream[str]):
    """Text deltas of a ``/v1/rag`` answer; after them ``answer``, ``documents`` and ``timeline``."""

    answer: str | None = None
    finish_reason: str | None = None
    documents: list[str] | None = None
    sources: list[dict[str, str]] | None = None

    async def _next_item(self) -> str | None:
        name, data = await self._event()
        body = json.loads(data)
        if name == "delta":
            return str(body["text"])
        if name == "error":
            raise _http_error(int(body.get("status", 500)), body, data)
        if name != "done":
            raise SpecragConnectionError(f"unexpected event {name!r} in the answer stream")
        done = RagAnswer.from_json(body)
        self.answer, self.finish_reason, self.documents = done.answer, done.finish_reason, done.documents
        self.sources = done.sources
        self.timeline = done.timeline
        self._finished = True
        return None


class ChatStream(_EventStream[dict[str, Any]]):
    """OpenAI ``chat.completion.chunk`` objects; the last one's ``specrag`` is kept as ``timeline``."""

    async def _next_item(self) -> dict[str, Any] | None:
        _, data = await self._event()
        if data == "[DONE]":
            self._finished = True
            return None
        chunk = json.loads(data)
        if "error" in chunk:
            raise _http_error(502, chunk, data)
        if "specrag" in chunk:
            self.timeline = chunk["specrag"]
        return dict(chunk)


class AsyncClient(_AsyncClosing):
    """Client of one specrag service; use as ``async with AsyncClient(url) as client``."""

    def __init__(
        self, base_url: str, *, api_token: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
        self._session: aiohttp.ClientSession | None = None
        self._headers = headers

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        # Created on first use so the session belongs to the loop that uses it.
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers)
        return self._session

    async def _open(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, streamed: bool = False
    ) -> aiohttp.ClientResponse:
        """Send a request; an error status raises. A stream's timeout is per read, not for the whole."""
        timeout = (
            aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s)
            if streamed
            else aiohttp.ClientTimeout(total=self.timeout_s)
        )
        with _translated(f"{method} {path}", self.timeout_s):
            response = await self._client().request(method, self.base_url + path, json=body, timeout=timeout)
            await _raise_for_status(response)
        return response

    async def _read(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """The decoded JSON body (``None`` for 204), or the text of a non-JSON one."""
        with _translated(f"{method} {path}", self.timeout_s):
            async with await self._open(method, path, body) as response:
                if response.status == 204:
                    return None
                if response.content_type == "application/json":
                    return await response.json()
                return await response.text()

    async def health(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._read("GET", "/health")
        return result

    async def rag(self, query: str, **options: Any) -> RagAnswer:
        """Ask a question; options are ``k``, ``mode``, ``max_tokens``, ``session_id`` and the
        penalties against repetition, ``frequency_penalty`` and ``presence_penalty`` (−2 to 2) and
        ``repetition_penalty`` (above 0; unset: the service's default). An engine that cannot apply
        a penalty (a simulated one) answers 400 naming it."""
        return RagAnswer.from_json(await self._read("POST", "/v1/rag", {"query": query, **options}))

    async def batch(self, queries: Sequence[str], **options: Any) -> RagBatch:
        """Ask questions known together; options are ``k``, ``mode``, ``max_tokens``. The service
        runs them in the order that shares the most prompt prefix and answers in the order asked."""
        if isinstance(queries, str):
            raise TypeError("queries must be a sequence of strings, not one string")
        return RagBatch.from_json(
            await self._read("POST", "/v1/rag/batch", {"queries": list(queries), **options})
        )

    def stream_rag(self, query: str, **options: Any) -> RagStream:
        """Ask a question with :meth:`rag`'s options; iterate over the answer's text as it is
        generated (opens on first use)."""
        return RagStream(self, "/v1/rag", {"query": query, **options, "stream": True})

    @overload
    async def chat(
        self, messages: list[dict[str, Any]], stream: Literal[False] = False, **options: Any
    ) -> dict[str, Any]: ...

    @overload
    async def chat(
        self, messages: list[dict[str, Any]], stream: Literal[True], **options: Any
    ) -> ChatStream: ...

    async def chat(
        self, messages: list[dict[str, Any]], stream: bool = False, **options: Any
    ) -> dict[str, Any] | ChatStream:
        """An OpenAI ``chat.completion`` (plus its ``specrag`` timeline) for the last user message;
        with ``stream=True`` a :class:`ChatStream` of ``chat.completion.chunk`` objects. Options are
        the chat fields of docs/service.md: OpenAI's sampling fields (``frequency_penalty`` and
        ``presence_penalty`` included) and :meth:`rag`'s, ``repetition_penalty`` among them."""
        body = {"messages": messages, **options, "stream": stream}
        if stream:
            return ChatStream(self, "/v1/chat/completions", body)
        result: dict[str, Any] = await self._read("POST", "/v1/chat/completions", body)
        return result

    async def create_session(self) -> str:
        """A new conversation; pass its id as ``session_id`` to continue it turn by turn."""
        result = await self._read("POST", "/v1/sessions", {})
        return str(result["session_id"])

    async def close_session(self, session_id: str) -> None:
        await self._read("DELETE", f"/v1/sessions/{quote(session_id, safe='')}")

    async def put_document(self, document_id: str, text: str, title: str = "") -> dict[str, Any]:
        """Add or replace one document: ``{"id", "version"}`` once it is durable and searchable;
        ``{"id", "version", "visible": False}`` when it is durable but not searchable yet (202: the
        service replays it, and takes no other write until it has)."""
        path = f"/v1/documents/{quote(document_id, safe='')}"
        result: dict[str, Any] = await self._read("PUT", path, {"title": title, "text": text})
        return result

    async def put_documents(self, documents: Sequence[dict[str, str]]) -> list[dict[str, Any]]:
        """Add or replace several documents (``{"id", "title", "text"}`` each) at once: one
        ``{"id", "version", "created", "visible"}`` each, in the order given."""
        result = await self._read("POST", "/v1/documents", {"documents": list(documents)})
        return list(result["documents"])

    async def get_document(self, document_id: str) -> dict[str, Any]:
        """The current version of a document: ``{"id", "title", "text", "version"}``."""
        result: dict[str, Any] = await self._read("GET", f"/v1/documents/{quote(document_id, safe='')}")
        return result

    async def delete_document(self, document_id: str) -> None:
        """Delete a document; a 404 :class:`SpecragHTTPError` when the id is unknown."""
        await self._read("DELETE", f"/v1/documents/{quote(document_id, safe='')}")

    async def metrics_text(self) -> str:
        """The service's metrics in Prometheus' text format."""
        return str(await self._read("GET", "/metrics"))
