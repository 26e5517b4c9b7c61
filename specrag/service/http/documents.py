"""The document API: add, replace, read and delete documents of the served corpus while it serves.

``PUT /v1/documents/{id}`` (``{"title", "text"}``: 201 when new, 200 when replaced, ``{"id",
"version"}``), ``POST /v1/documents`` (``{"documents": [{"id", "title", "text"}, ...]}``, at most
:data:`~specrag.pipeline.store.document_writes.MAX_BATCH_DOCUMENTS`, 413 beyond; 200 with ``{"documents":
[{"id", "version", "created", "visible"}, ...]}``), ``DELETE /v1/documents/{id}`` (204, 404 when
unknown) and ``GET /v1/documents/{id}``. A write is answered only once it is on disk and visible
to every search that starts afterwards (:mod:`specrag.pipeline.store.live_corpus`), with one exception:
a change that is durable but that the index could not apply yet is answered 202 (PUT ``{"id",
"version", "visible": false}``, POST with ``"visible": false`` per document, DELETE with no body);
searches see it once the corpus has replayed it. Until then writes are 503 with Retry-After
(:class:`~specrag.errors.WritesSuspendedError`) and ``/health`` says why (:func:`documents_health`).

Who may write: with tokens configured, reading stays open to every accepted token and a change
needs a writer's token (``--writer-tokens-file``; writer tokens are accepted for reading too).
Without tokens, only a request from this machine to this service may change documents
(:func:`~specrag.service.http.auth.local_refusal`: a loopback peer and a ``Host`` header naming this
service): anything else is 403, so that neither the network (a bind beyond loopback) nor a web
page in a local browser (DNS rebinding) can change the corpus.

Writes run one at a time on a thread of their own (:class:`WriteQueue`), never on the threads
queries need; at most :data:`MAX_WAITING_WRITES` wait for it, and a write beyond is 429 with
Retry-After.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from aiohttp import web

from specrag.errors import InvalidInputError, OverloadedError, TooLargeError
from specrag.pipeline.store.document_writes import MAX_BATCH_DOCUMENTS, Document, Written, check_document
from specrag.retrieval.corpus import Passage
from specrag.service.http.auth import check_tokens, local_refusal, matching_token
from specrag.service.http.bodies import check_fields
from specrag.service.http.in_flight import STATE
from specrag.service.http.wire import ErrorInfo, read_json_object

__all__ = [
    "CORPUS",
    "DOCUMENT_FIELDS",
    "MAX_WAITING_WRITES",
    "WRITERS",
    "WRITES",
    "DocumentCorpus",
    "WriteQueue",
    "attach_corpus",
    "delete_document",
    "documents_health",
    "documents_unavailable",
    "get_document",
    "post_documents",
    "put_document",
]

# Writes that may wait for the writer's thread (besides the one it runs): a write holds the
# corpus's lock while it embeds and commits, and a compaction holds it longer, so a burst beyond
# this would only grow a queue of callers waiting for their timeouts. Beyond it: 429.
MAX_WAITING_WRITES = 16
# How long a refused writer should wait: about one write's time, the queue moves by one.
_WRITE_RETRY_AFTER_S = 1.0

Result = TypeVar("Result")


class DocumentCorpus(Protocol):
    """What the document API needs of a corpus (:class:`~specrag.pipeline.store.live_corpus.LiveCorpus`)."""

    def get(self, passage_id: str) -> Document: ...

    def put(self, passages: Sequence[Passage]) -> list[Written]: ...

    def delete(self, passage_ids: Sequence[str]) -> bool: ...

    @property
    def suspended(self) -> str | None: ...

    def catch_up(self) -> bool: ...


class WriteQueue:
    """The corpus's writes, on one thread of their own, with at most ``max_waiting`` waiting.

    One thread is enough: the corpus takes one writer at a time. Its own thread keeps writers
    that wait for the corpus's lock (a compaction holds it) off the default executor, whose
    threads queries need. A write whose caller goes away before it starts never runs.
    """

    def __init__(self, max_waiting: int = MAX_WAITING_WRITES) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specrag-writer")
        self._limit = max_waiting + 1  # the one running and those waiting
        self._pending = 0
        self._lock = threading.Lock()  # _pending drops on the writer's thread

    def submit(self, call: Callable[[], Any]) -> None:
        """Run ``call`` on the writer's thread, not waited for (its failure stays the caller's
        to see elsewhere); refused like a write when the queue is full."""
        future = self._reserve(call)
        future.add_done_callback(lambda done: done.cancelled() or done.exception())

    def _reserve(self, call: Callable[..., Result], *args: Any) -> Future[Result]:
        """``call(*args)`` submitted to the writer's thread, counted while it runs or waits."""
        with self._lock:
            if self._pending >= self._limit:
                raise OverloadedError(
                    f"{self._pending - 1} document writes are waiting, the limit is {self._limit - 1}",
                    _WRITE_RETRY_AFTER_S,
                )
            self._pending += 1
        try:
            future = self._executor.submit(call, *args)
        except BaseException:
            self._done(None)
            raise
        future.add_done_callback(self._done)  # run, failed or cancelled before it started
        return future

    async def run(self, call: Callable[..., Result], *args: Any) -> Result:
        """``call(*args)`` on the writer's thread, or :class:`OverloadedError` when the queue is full."""
        return await asyncio.wrap_future(self._reserve(call, *args))

    @property
    def pending(self) -> int:
        """The writes running or waiting for the writer's thread."""
        return self._pending

    def _done(self, _: Future[Any] | None) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        """Finish the write in progress; those still waiting do not run."""
        self._executor.shutdown(wait=True, cancel_futures=True)


CORPUS = web.AppKey("specrag_corpus", DocumentCorpus)
WRITERS = web.AppKey("specrag_writer_tokens", tuple)
WRITES = web.AppKey("specrag_writes", WriteQueue)
DOCUMENT_FIELDS = frozenset({"title", "text"})
_BATCH_FIELDS = frozenset({"documents"})
_BATCH_DOCUMENT_FIELDS = frozenset({"id", "title", "text"})


def attach_corpus(app: web.Application, corpus: DocumentCorpus, writer_tokens: Sequence[str] = ()) -> None:
    """Give ``app`` (being made by :func:`~specrag.service.http.app.create_app`, whose route table
    holds the document routes) ``corpus`` and its writers: ``writer_tokens`` may change documents
    (and are accepted for reading as well). The writer's thread stops when the application is
    cleaned up."""
    state = app[STATE]
    writers = tuple(writer_tokens)
    check_tokens(writers, "Access.writer_tokens")
    if set(writers) & set(state.tokens):
        raise InvalidInputError("a writer token is also a reader's token: give writers their own")
    state.tokens = (*state.tokens, *writers)
    app[CORPUS] = corpus
    app[WRITERS] = writers
    app[WRITES] = WriteQueue()
    app.on_cleanup.append(_close_writes)


async def _close_writes(app: web.Application) -> None:
    await asyncio.to_thread(app[WRITES].close)  # waits for the write in progress: not on the loop


def _check_writer(request: web.Request) -> None:
    """403 unless the request may change documents: with tokens, it carries a writer's (the auth
    middleware has already checked that it is an accepted token); without, it comes from this
    machine to this service."""
    state = request.app[STATE]
    if state.tokens:
        writers: tuple[str, ...] = request.app[WRITERS]
        if matching_token(request.headers.get("Authorization"), writers) is None:
            raise web.HTTPForbidden(
                text="this token may not change documents: use a writer's token (--writer-tokens-file)"
            )
        return
    refusal = local_refusal(request, state.trust_forwarded_for)
    if refusal is not None:
        raise web.HTTPForbidden(
            text=f"without a writer's token only this machine may change documents, and this request "
            f"does not come from it: {refusal}. Serve with --writer-tokens-file to change documents "
            "from elsewhere"
        )


def _document_json(document: Document) -> dict[str, Any]:
    return {"id": document.id, "title": document.title, "text": document.text, "version": document.version}


async def put_document(request: web.Request) -> web.Response:
    _check_writer(request)
    body = await read_json_object(request, request.app[STATE].limits)
    check_fields(body, DOCUMENT_FIELDS, "unknown fields in the document")
    passage = check_document(request.match_info["document_id"], body.get("title", ""), body.get("text"))
    (written,) = await request.app[WRITES].run(request.app[CORPUS].put, [passage])
    if not written.visible:
        return web.json_response({"id": written.id, "version": written.version, "visible": False}, status=202)
    return web.json_response(
        {"id": written.id, "version": written.version}, status=201 if written.created else 200
    )


async def post_documents(request: web.Request) -> web.Response:
    _check_writer(request)
    body = await read_json_object(request, request.app[STATE].limits)
    check_fields(body, _BATCH_FIELDS, "unknown fields in the request")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise InvalidInputError('\'documents\' must be a non-empty list of {"id", "title", "text"} objects')
    if len(documents) > MAX_BATCH_DOCUMENTS:
        raise TooLargeError(f"at most {MAX_BATCH_DOCUMENTS} documents a request, got {len(documents)}")
    passages = []
    for document in documents:
        if not isinstance(document, dict):
            raise InvalidInputError("each of 'documents' must be an object with 'id', 'title' and 'text'")
        check_fields(document, _BATCH_DOCUMENT_FIELDS, "unknown fields in a document")
        passages.append(check_document(document.get("id"), document.get("title", ""), document.get("text")))
    written = await request.app[WRITES].run(request.app[CORPUS].put, passages)
    return web.json_response(
        {
            "documents": [
                {"id": one.id, "version": one.version, "created": one.created, "visible": one.visible}
                for one in written
            ]
        },
        status=200 if all(one.visible for one in written) else 202,
    )


async def get_document(request: web.Request) -> web.Response:
    document = request.app[CORPUS].get(request.match_info["document_id"])
    return web.json_response(_document_json(document))


async def delete_document(request: web.Request) -> web.Response:
    _check_writer(request)
    visible = await request.app[WRITES].run(request.app[CORPUS].delete, [request.match_info["document_id"]])
    return web.Response(status=204 if visible else 202)


def documents_health(app: web.Application) -> dict[str, Any]:
    """What ``/health`` says of the document API: whether the corpus takes writes and, when it
    does not, why; a replay of the pending change is started on the writer's thread (one at a
    time), so a corpus whose apply failed recovers without waiting for the next write."""
    corpus, writes = app[CORPUS], app[WRITES]
    reason = corpus.suspended
    if reason is None:
        return {"documents": {"writes": "open", "waiting": writes.pending}}
    if not writes.pending:
        writes.submit(corpus.catch_up)
    return {"documents": {"writes": "suspended", "reason": reason, "waiting": writes.pending}}


def documents_unavailable(reason: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A handler for every document route of a service whose corpus cannot change through it
    (a database table is written by its own writers): 501 saying ``reason``, not a bare 404 that
    would leave a client guessing whether the path or the document is wrong."""

    async def refuse(request: web.Request) -> web.Response:
        return ErrorInfo(501, reason, "not_implemented_error", "documents_unavailable").response()

    return refuse
