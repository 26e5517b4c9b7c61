"""Who may change documents, what a write is answered, and how writes queue beside queries.

Over real loopback HTTP, on a stand-in corpus (:class:`StandInCorpus`) whose writes can be held
back, made to fail or left invisible: what is tested is the service's side of the document API.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from specrag.cli import main
from specrag.client import AsyncClient
from specrag.controller.controller import RagController
from specrag.errors import InvalidInputError, NotFoundError, WritesSuspendedError
from specrag.pipeline.store.document_writes import Document, Written, check_document
from specrag.retrieval.corpus import Passage
from specrag.service.http.access import Access
from specrag.service.http.app import create_app, serving
from specrag.service.http.auth import local_refusal
from specrag.service.http.documents import MAX_WAITING_WRITES, WRITES
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import make_controller
from tests.helpers.http import TOKEN
from tests.helpers.waiting import wait_until

WRITER = "writer-token-789"
HELD_S = 30.0  # the longest a held write waits for its release: a test that forgets it still ends


class StandInCorpus:
    """A corpus in a dict whose ``put`` can be held back (``release``), fail, or be left invisible."""

    def __init__(self) -> None:
        self.documents: dict[str, Document] = {}
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()
        self.visible = True
        self.failure: Exception | None = None
        self.fail_at_call: int | None = None
        self.calls = 0
        self.suspended: str | None = None
        self.catch_ups = threading.Event()

    def get(self, passage_id: str) -> Document:
        if passage_id not in self.documents:
            raise NotFoundError(f"unknown document id {passage_id!r}")
        return self.documents[passage_id]

    def put(self, passages: Sequence[Passage]) -> list[Written]:
        self.calls += 1
        self.entered.set()
        if not self.release.wait(HELD_S):
            raise TimeoutError("the test never released the held write")
        if self.failure is not None and self.fail_at_call in (None, self.calls):
            raise self.failure
        written = []
        for passage in passages:
            before = self.documents.get(passage.id)
            version = 1 if before is None else before.version + 1
            self.documents[passage.id] = Document(passage.id, passage.title, passage.text, version)
            written.append(Written(passage.id, version, before is None, self.visible))
        return written

    def delete(self, passage_ids: Sequence[str]) -> bool:
        for passage_id in passage_ids:
            self.get(passage_id)
            del self.documents[passage_id]
        return self.visible

    def catch_up(self) -> bool:
        self.catch_ups.set()
        self.suspended = None
        return True


@dataclass
class Service:
    url: str
    port: int
    app: web.Application
    corpus: StandInCorpus


@pytest_asyncio.fixture
async def controller(tiny_assets: Assets) -> AsyncIterator[RagController]:
    controller = make_controller(SimulatedEngine(time_scale=0.01, max_model_len=4096), tiny_assets)
    try:
        yield controller
    finally:
        await controller.close()


@pytest_asyncio.fixture
async def open_service(controller: RagController) -> AsyncIterator[Service]:
    """The document API without tokens, on 127.0.0.1."""
    corpus = StandInCorpus()
    app = create_app(controller, corpus=corpus)
    async with serving(app, access_log=False) as url:
        yield Service(url, int(url.rsplit(":", 1)[1]), app, corpus)
        corpus.release.set()


async def _status(
    http: aiohttp.ClientSession, method: str, url: str, body: object = None, **headers: str
) -> tuple[int, str]:
    async with http.request(method, url, json=body, headers=headers) as response:
        return response.status, await response.text()


# ------------------------------------------------------------------------------- who may write


async def test_without_tokens_only_a_request_naming_this_service_on_loopback_may_write(
    open_service: Service,
) -> None:
    url, port = open_service.url, open_service.port
    document = f"{url}/v1/documents/doc"
    async with aiohttp.ClientSession() as http:
        assert (await _status(http, "PUT", document, {"text": "first"}))[0] == 201  # Host 127.0.0.1:port
        for host in (f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}"):
            assert (await _status(http, "PUT", document, {"text": host}, Host=host))[0] == 200, host

        # A page whose own name now resolves to 127.0.0.1 (DNS rebinding), another port, a proxy.
        for headers in (
            {"Host": f"attacker.example:{port}"},
            {"Host": "attacker.example"},
            {"Host": f"127.0.0.1:{port + 1}"},
            {"Host": "localhost"},
            {"X-Forwarded-For": "203.0.113.7"},
            {"Forwarded": "for=203.0.113.7"},
        ):
            for method, path, body in (
                ("PUT", "/v1/documents/doc", {"text": "changed"}),
                ("POST", "/v1/documents", {"documents": [{"id": "other", "text": "x"}]}),
                ("DELETE", "/v1/documents/doc", None),
            ):
                status, text = await _status(http, method, url + path, body, **headers)
                assert status == 403, (method, headers, text)
                assert "only this machine may change documents" in text
                assert "--writer-tokens-file" in text

        # Reads are not writes: any Host reads.
        status, text = await _status(http, "GET", document, Host=f"attacker.example:{port}")
        assert status == 200 and json.loads(text)["text"] == f"[::1]:{port}"
    assert set(open_service.corpus.documents) == {"doc"}


async def test_a_writer_s_token_writes_from_any_host(controller: RagController) -> None:
    corpus = StandInCorpus()
    app = create_app(controller, Access(tokens=(TOKEN,), writer_tokens=(WRITER,)), corpus=corpus)
    async with serving(app, access_log=False) as url, aiohttp.ClientSession() as http:
        foreign = {"Host": "attacker.example", "X-Forwarded-For": "203.0.113.7"}
        writer = {"Authorization": f"Bearer {WRITER}", **foreign}
        reader = {"Authorization": f"Bearer {TOKEN}"}
        assert (await _status(http, "PUT", f"{url}/v1/documents/doc", {"text": "x"}, **writer))[0] == 201
        status, text = await _status(http, "PUT", f"{url}/v1/documents/doc", {"text": "y"}, **reader)
        assert status == 403 and "writer's token" in text  # a reader's token, even from here
        assert (await _status(http, "GET", f"{url}/v1/documents/doc", **reader))[0] == 200
        assert (await _status(http, "DELETE", f"{url}/v1/documents/doc", **writer))[0] == 204


async def test_behind_a_trusted_proxy_a_loopback_peer_is_the_proxy_and_may_not_write(
    controller: RagController,
) -> None:
    app = create_app(controller, Access(trust_forwarded_for=True), corpus=StandInCorpus())
    async with serving(app, access_log=False) as url, aiohttp.ClientSession() as http:
        status, text = await _status(http, "PUT", f"{url}/v1/documents/doc", {"text": "x"})
        assert status == 403 and "through a proxy" in text


@pytest.mark.parametrize(
    ("peer", "host", "refused"),
    [
        ("127.0.0.1", "127.0.0.1:8000", False),
        ("127.0.0.5", "localhost:8000", False),
        ("::1", "[::1]:8000", False),
        ("::ffff:127.0.0.1", "localhost:8000", False),
        ("192.0.2.10", "127.0.0.1:8000", True),  # the network, naming the service correctly
        ("::ffff:192.0.2.10", "localhost:8000", True),
        ("127.0.0.1", "::1:8000", True),  # an IPv6 address is bracketed in a Host header
        ("127.0.0.1", "127.0.0.1:8000@attacker.example", True),
        ("127.0.0.1", "", True),
    ],
)
def test_from_this_machine_takes_a_loopback_peer_and_a_host_naming_this_port(
    peer: str, host: str, refused: bool
) -> None:
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name: {
        "peername": (peer, 50000),
        "sockname": ("127.0.0.1", 8000),
    }.get(name)
    headers = {"Host": host} if host else {}
    request = make_mocked_request("PUT", "/v1/documents/a", headers=headers, transport=transport)
    assert (local_refusal(request, behind_proxy=False) is not None) is refused


# --------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("passage_id", "title", "text", "says"),
    [
        ("\ud800", "", "text", "not valid Unicode"),
        ("a", "\udfff", "text", "not valid Unicode"),
        ("a", "", "before \ud800 after", "not valid Unicode text: a lone surrogate at character 7"),
        (".", "", "text", "cannot be named in a URL"),
        ("..", "", "text", "cannot be named in a URL"),
        (" a", "", "text", "starts or ends with a blank"),
        ("a ", "", "text", "starts or ends with a blank"),
    ],
)
def test_a_lone_surrogate_and_an_id_a_url_cannot_name_are_refused(
    passage_id: str, title: str, text: str, says: str
) -> None:
    with pytest.raises(InvalidInputError, match=says):
        check_document(passage_id, title, text)


async def test_every_other_id_is_reachable_through_the_client(open_service: Service) -> None:
    """The client quotes an id whole (``/`` too), and the service matches it as one segment."""
    ids = ["a/b", "a/../b", "./a", "a%2Fb", "%", "a?b#c", "a b", "é", "a\\b", "a..", "...", "~"]
    async with AsyncClient(open_service.url) as client:
        for passage_id in ids:
            check_document(passage_id, "", "text")
            assert (await client.put_document(passage_id, f"text of {passage_id}"))["version"] == 1
            assert (await client.get_document(passage_id))["text"] == f"text of {passage_id}"
            await client.delete_document(passage_id)
    assert not open_service.corpus.documents


# ---------------------------------------------------------------- what a write is answered


async def test_a_durable_write_the_index_has_not_applied_is_202_and_says_so(open_service: Service) -> None:
    open_service.corpus.visible = False
    url = open_service.url
    async with aiohttp.ClientSession() as http:
        async with http.put(f"{url}/v1/documents/doc", json={"text": "x"}) as response:
            assert (response.status, await response.json()) == (
                202,
                {"id": "doc", "version": 1, "visible": False},
            )
        async with http.post(
            f"{url}/v1/documents", json={"documents": [{"id": "b", "text": "y"}]}
        ) as response:
            assert response.status == 202
            assert (await response.json())["documents"] == [
                {"id": "b", "version": 1, "created": True, "visible": False}
            ]
        open_service.corpus.visible = True
        async with http.post(
            f"{url}/v1/documents", json={"documents": [{"id": "b", "text": "z"}]}
        ) as response:
            assert response.status == 200
            assert (await response.json())["documents"][0]["visible"] is True


async def test_writes_suspended_by_the_corpus_are_503_with_retry_after(open_service: Service) -> None:
    open_service.corpus.failure = WritesSuspendedError("replaying a change", retry_after_s=3)
    async with (
        aiohttp.ClientSession() as http,
        http.put(f"{open_service.url}/v1/documents/doc", json={"text": "x"}) as response,
    ):
        assert response.status == 503 and response.headers["Retry-After"] == "3"
        assert (await response.json())["error"]["code"] == "writes_suspended"


# ------------------------------------------------------------------------------ the write queue


async def test_writes_queue_on_their_own_thread_up_to_a_bound_and_queries_still_answer(
    open_service: Service,
) -> None:
    url, corpus, queue = open_service.url, open_service.corpus, open_service.app[WRITES]
    corpus.release.clear()
    async with aiohttp.ClientSession() as http:
        held = [
            asyncio.create_task(_status(http, "PUT", f"{url}/v1/documents/d{i}", {"text": f"text {i}"}))
            for i in range(MAX_WAITING_WRITES + 1)  # one running, the rest waiting
        ]
        await wait_until(lambda: queue.pending == MAX_WAITING_WRITES + 1, 20, what=lambda: f"{queue.pending}")
        assert corpus.entered.is_set()
        async with http.put(f"{url}/v1/documents/one-too-many", json={"text": "x"}) as response:
            assert response.status == 429 and int(response.headers["Retry-After"]) >= 1
            assert f"the limit is {MAX_WAITING_WRITES}" in (await response.json())["error"]["message"]

        async with asyncio.timeout(20):  # reads and queries do not wait for the writer
            assert (await _status(http, "GET", f"{url}/v1/documents/never"))[0] == 404
            async with AsyncClient(url) as client:
                answer = await client.rag(
                    "How does the quokka module count?", k=2, mode="serial", max_tokens=2
                )
            assert answer.documents

        corpus.release.set()
        async with asyncio.timeout(20):
            statuses = [status for status, _ in await asyncio.gather(*held)]
        assert statuses == [201] * (MAX_WAITING_WRITES + 1)
        assert (await _status(http, "PUT", f"{url}/v1/documents/one-too-many", {"text": "x"}))[0] == 201
    assert queue.pending == 0


def writer_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """The writers' threads started since ``before``."""
    return [
        thread for thread in set(threading.enumerate()) - before if thread.name.startswith("specrag-writer")
    ]


async def test_the_writer_s_thread_ends_with_the_service(controller: RagController) -> None:
    before = set(threading.enumerate())
    app = create_app(controller, corpus=StandInCorpus())
    async with serving(app, access_log=False) as url, AsyncClient(url) as client:
        await client.put_document("doc", "x")
        assert writer_threads(before)
    await wait_until(lambda: not writer_threads(before), 10, what=lambda: f"{writer_threads(before)}")


# ------------------------------------------------------------------- a partial import


def _documents_file(path: Path, count: int) -> Path:
    """``count`` documents, a blank line after the first (lines and documents do not coincide)."""
    lines = [json.dumps({"id": f"d{i}", "text": f"text {i}"}) for i in range(count)]
    path.write_text("\n".join([lines[0], "", *lines[1:]]) + "\n")
    return path


async def test_an_import_failing_part_way_prints_what_was_committed_and_where_to_resume(
    open_service: Service,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr("specrag.service.cli.document_commands.MAX_BATCH_DOCUMENTS", 3)
    corpus = open_service.corpus
    corpus.failure, corpus.fail_at_call = WritesSuspendedError("replaying a change"), 2
    documents = _documents_file(tmp_path / "seven.jsonl", 7)
    argv = ["documents", "add", str(documents), "--url", open_service.url]
    assert await asyncio.to_thread(main, argv) == 2
    out, err = capsys.readouterr()
    assert [json.loads(line)["id"] for line in out.splitlines()] == ["d0", "d1", "d2"]
    assert set(corpus.documents) == {"d0", "d1", "d2"}
    assert f"3 of 7 documents committed (printed above); batch 2 of 3, from {documents} line 5," in err
    assert "add again from line 5 on" in err
    assert "503" in err  # and the error itself, after


async def test_a_durable_delete_the_index_has_not_applied_is_202(open_service: Service) -> None:
    open_service.corpus.documents["a"] = Document("a", "", "text", 1)
    open_service.corpus.visible = False
    async with aiohttp.ClientSession() as http:
        status, _ = await _status(http, "DELETE", f"{open_service.url}/v1/documents/a")
    assert status == 202


async def test_health_says_writes_are_suspended_and_starts_the_replay(open_service: Service) -> None:
    corpus = open_service.corpus
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{open_service.url}/health") as response:
            assert (await response.json())["documents"] == {"writes": "open", "waiting": 0}
        corpus.suspended = "the vector index failed: injected"
        async with http.get(f"{open_service.url}/health") as response:
            documents = (await response.json())["documents"]
        assert documents["writes"] == "suspended" and "injected" in documents["reason"]
        assert await asyncio.to_thread(corpus.catch_ups.wait, 10.0)  # replayed on the writer's thread
        await wait_until(lambda: open_service.app[WRITES].pending == 0)
        async with http.get(f"{open_service.url}/health") as response:
            assert (await response.json())["documents"]["writes"] == "open"
