"""``specrag documents``: add, replace, read and delete documents, through a running service or offline.

With ``--url`` the command talks to that service (``/v1/documents``, :mod:`specrag.service.http.documents`),
which serves each change as soon as it answers. Without, it changes the data directory's corpus
itself: the change is logged beside the document store (:mod:`specrag.pipeline.store.live_store`) and the
next ``specrag serve`` replays it. Offline writes are for a data directory no service is serving:
the serving process holds the log's lock, and an offline command meets it at once
and stops, saying so (:mod:`specrag.pipeline.store.live_store`).

``add`` prints one JSON line per document written. A file of more than
:data:`~specrag.pipeline.store.document_writes.MAX_BATCH_DOCUMENTS` documents goes in batches, each its own
transaction: when one fails, the lines printed are exactly the documents committed, and standard
error says how many and from which line of the file to add again (exit status 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from specrag.client import AsyncClient
from specrag.controller.config import ControllerConfig
from specrag.errors import InvalidInputError
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.store.document_writes import MAX_BATCH_DOCUMENTS, check_document
from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.corpus import Passage
from specrag.service.cli.commands import token_from_env
from specrag.service.run.assets import ensure_assets
from specrag.service.run.options import default_context_length

__all__ = ["Line", "documents_command", "read_documents", "register"]


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


class Line(NamedTuple):
    """A document of a JSONL file and the line it is on."""

    number: int
    passage: Passage


def read_documents(path: str) -> list[Line]:
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
            passage = check_document(record.get("id"), record.get("title", ""), record.get("text"))
        except (json.JSONDecodeError, InvalidInputError) as error:
            raise InvalidInputError(f"{path}, line {number}: {error}") from None
        documents.append(Line(number, passage))
    if not documents:
        raise InvalidInputError(f"{path} holds no document")
    return documents


def _batches(documents: list[Line]) -> Iterator[list[Passage]]:
    for start in range(0, len(documents), MAX_BATCH_DOCUMENTS):
        yield [line.passage for line in documents[start : start + MAX_BATCH_DOCUMENTS]]


def _print(lines: list[dict[str, Any]]) -> None:
    """Each of ``lines`` as JSON on standard output, there before anything later on standard error."""
    for line in lines:
        print(json.dumps(line, ensure_ascii=False))
    sys.stdout.flush()


def _report_partial(path: str, documents: list[Line], committed: int) -> None:
    """On standard error, what an import of several batches that failed part-way left committed
    (each batch is one transaction: the JSON lines printed are exactly those committed). Nothing
    for an import of one batch: its error says it all."""
    if len(documents) <= MAX_BATCH_DOCUMENTS:
        return
    batches = -(-len(documents) // MAX_BATCH_DOCUMENTS)
    failed = documents[committed].number
    print(
        f"specrag documents add: {committed} of {len(documents)} documents committed (printed "
        f"above); batch {committed // MAX_BATCH_DOCUMENTS + 1} of {batches}, from {path} line "
        f"{failed}, failed and nothing after it was sent: add again from line {failed} on "
        "(adding a document again makes a new version)",
        file=sys.stderr,
    )


def documents_command(args: argparse.Namespace) -> int:
    documents = read_documents(args.file) if args.action == "add" else []
    if args.url is not None:
        asyncio.run(_online(args, documents))
        return 0
    assets = ensure_assets(DataLayout(resolve_data_dir(args.data_dir)), args.model)
    assert isinstance(assets.corpus, LiveCorpus)  # the data directory's own corpus: never a table
    # As a default `serve` would limit them; the engine's block padding is not known offline.
    builder = PromptBuilder(assets.tokenizer, assets.store)
    assets.corpus.segment_token_limit = builder.document_token_limit(
        default_context_length(assets.model_dir), ControllerConfig.max_tokens_default
    )
    _offline(args, assets.corpus, documents)
    return 0


async def _online(args: argparse.Namespace, documents: list[Line]) -> None:
    async with AsyncClient(args.url, api_token=token_from_env(args.api_token_env)) as client:
        if args.action == "get":
            _print([await client.get_document(args.id)])
            return
        if args.action == "delete":
            for document_id in args.ids:
                await client.delete_document(document_id)
            _print([{"deleted": document_id} for document_id in args.ids])
            return
        committed = 0
        try:
            for batch in _batches(documents):
                written = await client.put_documents(
                    [{"id": one.id, "title": one.title, "text": one.text} for one in batch]
                )
                _print(written)
                committed += len(written)
        except BaseException:  # an interrupt too: say what went in before it
            _report_partial(args.file, documents, committed)
            raise


def _offline(args: argparse.Namespace, corpus: LiveCorpus, documents: list[Line]) -> None:
    if args.action == "get":
        document = corpus.get(args.id)
        _print(
            [{"id": document.id, "title": document.title, "text": document.text, "version": document.version}]
        )
        return
    if args.action == "delete":
        corpus.delete(args.ids)
        _print([{"deleted": document_id} for document_id in args.ids])
        return
    committed = 0
    try:
        for batch in _batches(documents):
            written = corpus.put(batch)
            _print([{"id": one.id, "version": one.version, "created": one.created} for one in written])
            committed += len(written)
    except BaseException:  # an interrupt too: say what went in before it
        _report_partial(args.file, documents, committed)
        raise
