"""The document API: add, replace, read and delete documents of the served corpus while it serves.

``PUT /v1/documents/{id}`` (``{"title", "text"}``: 201 when new, 200 when replaced, ``{"id",
"version"}``), ``POST /v1/documents`` (``{"documents": [{"id", "title", "text"}, ...]}``, at most
:data:`~specrag.pipeline.live_corpus.MAX_BATCH_DOCUMENTS`, 413 beyond), ``DELETE
/v1/documents/{id}`` (204, 404 when unknown) and ``GET /v1/documents/{id}``. A write is answered
only once it is on disk and visible to every search that starts afterwards
(:mod:`specrag.pipeline.live_corpus`).

With tokens configured, reading stays open to every accepted token and a change needs a writer's
token (``--writer-tokens-file``): 403 otherwise. Writer tokens are accepted for reading too.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from specrag.errors import InvalidInputError, TooLargeError
from specrag.pipeline.live_corpus import MAX_BATCH_DOCUMENTS, Document, LiveCorpus, check_document
from specrag.service.admission import STATE
from specrag.service.bodies import check_fields
from specrag.service.wire import parse_json_object, read_body

__all__ = ["CORPUS", "DOCUMENT_FIELDS", "WRITERS", "add_document_routes"]

CORPUS = web.AppKey("specrag_corpus", LiveCorpus)
WRITERS = web.AppKey("specrag_writer_tokens", tuple)
DOCUMENT_FIELDS = frozenset({"title", "text"})
_BATCH_FIELDS = frozenset({"documents"})
_BATCH_DOCUMENT_FIELDS = frozenset({"id", "title", "text"})


def add_document_routes(app: web.Application, corpus: LiveCorpus, writer_tokens: Sequence[str] = ()) -> None:
    """Serve ``corpus``'s document API on ``app`` (made by :func:`~specrag.service.server.create_app`);
    ``writer_tokens`` may change documents (and are accepted for reading as well)."""
    state = app[STATE]
    writers = tuple(writer_tokens)
    if not all(token and isinstance(token, str) for token in writers) or len(set(writers)) < len(writers):
        raise InvalidInputError("the writer tokens must be non-empty strings, each given once")
    if set(writers) & set(state.tokens):
        raise InvalidInputError("a writer token is also a reader's token: give writers their own")
    state.tokens = (*state.tokens, *writers)
    app[CORPUS] = corpus
    app[WRITERS] = writers
    app.router.add_put("/v1/documents/{document_id}", _put)
    app.router.add_post("/v1/documents", _post)
    app.router.add_get("/v1/documents/{document_id}", _get)
    app.router.add_delete("/v1/documents/{document_id}", _delete)


def _check_writer(request: web.Request) -> None:
    """403 unless tokens are off or the request's token is a writer's (the auth middleware has
    already checked that it is an accepted token)."""
    if not request.app[STATE].tokens:
        return
    provided = request.headers.get("Authorization", "").partition(" ")[2].strip().encode()
    if not any([hmac.compare_digest(provided, token.encode()) for token in request.app[WRITERS]]):
        raise web.HTTPForbidden(
            text="this token may not change documents: use a writer's token (--writer-tokens-file)"
        )


async def _body(request: web.Request) -> dict[str, Any]:
    if request.content_type != "application/json":
        raise web.HTTPUnsupportedMediaType(text="the body must be JSON (Content-Type: application/json)")
    return parse_json_object(await read_body(request, request.app[STATE].limits))


def _document_json(document: Document) -> dict[str, Any]:
    return {"id": document.id, "title": document.title, "text": document.text, "version": document.version}


async def _put(request: web.Request) -> web.Response:
    _check_writer(request)
    body = await _body(request)
    check_fields(body, DOCUMENT_FIELDS, "unknown fields in the document")
    passage = check_document(request.match_info["document_id"], body.get("title", ""), body.get("text"))
    corpus = request.app[CORPUS]
    (written,) = await asyncio.get_running_loop().run_in_executor(None, corpus.put, [passage])
    return web.json_response(
        {"id": written.id, "version": written.version}, status=201 if written.created else 200
    )


async def _post(request: web.Request) -> web.Response:
    _check_writer(request)
    body = await _body(request)
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
    corpus = request.app[CORPUS]
    written = await asyncio.get_running_loop().run_in_executor(None, corpus.put, passages)
    return web.json_response(
        {"documents": [{"id": one.id, "version": one.version, "created": one.created} for one in written]}
    )


async def _get(request: web.Request) -> web.Response:
    document = request.app[CORPUS].get(request.match_info["document_id"])
    return web.json_response(_document_json(document))


async def _delete(request: web.Request) -> web.Response:
    _check_writer(request)
    corpus = request.app[CORPUS]
    await asyncio.get_running_loop().run_in_executor(None, corpus.delete, [request.match_info["document_id"]])
    return web.Response(status=204)
