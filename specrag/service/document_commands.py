"""``specrag documents``: add, replace, read and delete documents, through a running service or offline.

With ``--url`` the command talks to that service (``/v1/documents``, :mod:`specrag.service.documents`),
which serves each change as soon as it answers. Without, it changes the data directory's corpus
itself: the change is logged beside the document store (:mod:`specrag.pipeline.live_store`) and the
next ``specrag serve`` replays it. Offline writes are for a data directory no service is serving:
a service notices another writer's changes at its next write and refuses it (409).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specrag.client import AsyncClient
from specrag.errors import InvalidInputError
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.live_corpus import MAX_BATCH_DOCUMENTS, LiveCorpus, check_document
from specrag.retrieval.corpus import Passage
from specrag.service.assets import ensure_assets
from specrag.service.handlers import _api_token

__all__ = ["documents_command", "read_documents", "register"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    documents = subparsers.add_parser(
        "documents",
        help="add, replace, show or delete documents of the corpus (live through --url, else offline)",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    actions = documents.add_subparsers(dest="action", metavar="ACTION", required=True)
    add = actions.add_parser(
        "add", help="add or replace the documents of a JSONL file ({id, title, text} a line)"
    )
    add.add_argument(
        "file", metavar="FILE.jsonl", help="documents, one JSON object a line (- reads standard input)"
    )
    delete = actions.add_parser("delete", help="delete documents by id")
    delete.add_argument("ids", metavar="ID", nargs="+")
    show = actions.add_parser("get", help="print a document's current version as JSON")
    show.add_argument("id", metavar="ID")
    for parser in (add, delete, show):
        parser.add_argument(
            "--url", help="a running specrag service (default: change the data directory offline)"
        )
        parser.add_argument(
            "--api-token-env", metavar="VAR", help="the service's (writer's) bearer token is in $VAR"
        )
        parser.add_argument(
            "--model", help="offline: the model whose store to change (default: the default model)"
        )
        parser.set_defaults(handler=documents_command)


def read_documents(path: str) -> list[Passage]:
    """The documents of a JSONL file, each checked (InvalidInputError names the bad line)."""
    try:
        lines = (
            sys.stdin.read().splitlines()
            if path == "-"
            else Path(path).read_text(encoding="utf-8").splitlines()
        )
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidInputError(f"cannot read {path}: {error}") from None
    documents = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise InvalidInputError("expected a JSON object")
            documents.append(check_document(record.get("id"), record.get("title", ""), record.get("text")))
        except (json.JSONDecodeError, InvalidInputError) as error:
            raise InvalidInputError(f"{path}, line {number}: {error}") from None
    if not documents:
        raise InvalidInputError(f"{path} holds no document")
    return documents


def _batches(documents: list[Passage]) -> Iterator[list[Passage]]:
    for start in range(0, len(documents), MAX_BATCH_DOCUMENTS):
        yield documents[start : start + MAX_BATCH_DOCUMENTS]


def documents_command(args: argparse.Namespace) -> int:
    documents = read_documents(args.file) if args.action == "add" else []
    if args.url is not None:
        for line in asyncio.run(_online(args, documents)):
            print(json.dumps(line, ensure_ascii=False))
        return 0
    assets = ensure_assets(DataLayout(resolve_data_dir(args.data_dir)), args.model)
    assert assets.corpus is not None
    for line in _offline(args, assets.corpus, documents):
        print(json.dumps(line, ensure_ascii=False))
    return 0


async def _online(args: argparse.Namespace, documents: list[Passage]) -> list[dict[str, Any]]:
    async with AsyncClient(args.url, api_token=_api_token(args.api_token_env)) as client:
        if args.action == "get":
            return [await client.get_document(args.id)]
        if args.action == "delete":
            for document_id in args.ids:
                await client.delete_document(document_id)
            return [{"deleted": document_id} for document_id in args.ids]
        written = []
        for batch in _batches(documents):
            written += await client.put_documents(
                [{"id": one.id, "title": one.title, "text": one.text} for one in batch]
            )
        return written


def _offline(args: argparse.Namespace, corpus: LiveCorpus, documents: list[Passage]) -> list[dict[str, Any]]:
    if args.action == "get":
        document = corpus.get(args.id)
        return [
            {"id": document.id, "title": document.title, "text": document.text, "version": document.version}
        ]
    if args.action == "delete":
        corpus.delete(args.ids)
        return [{"deleted": document_id} for document_id in args.ids]
    written = []
    for batch in _batches(documents):
        written += [
            {"id": one.id, "version": one.version, "created": one.created} for one in corpus.put(batch)
        ]
    return written
