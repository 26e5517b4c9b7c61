"""Every entry point against a catalogue of malformed input: a precise error, never a 500 or a crash.

Three tables, one per entry point: HTTP requests (shared with ``bench.faults`` through
:mod:`bench.faults.inputs`; the service here has 2-second read timeouts, so the half-sent requests
end quickly), command lines (exit status 2 and a one-line message, or argparse's
usage error) and Python calls (a typed exception and its message). The HTTP rows run against one
service on the session's real engine; the last test checks that after the whole catalogue that
service still answers and that nothing of the rejected requests is left in the engine.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from bench.faults.inputs import BAD_REQUESTS, QUESTION, BadRequest, send
from specrag.cli import main
from specrag.client import AsyncClient, SpecragConnectionError, SpecragHTTPError
from specrag.controller.controller import ControllerConfig, RagController, RagRequest
from specrag.errors import ArtifactError, ConflictError, InvalidInputError, NotFoundError
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.pipeline.store.document_store import DocumentStore
from specrag.retrieval.corpus import load_passages
from specrag.retrieval.index_store import load_index
from specrag.service.http.access import Access
from specrag.service.http.app import create_app, serving
from specrag.service.run.assets import Assets
from tests.helpers.builders import make_controller
from tests.helpers.http import free_port

pytestmark = pytest.mark.engine

TOKEN = "catalogue-token"


@dataclass
class Service:
    url: str
    controller: RagController
    engine: VllmEngine
    data_dir: Path
    store_file: Path


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def service(vllm_engine: VllmEngine, tiny_assets: Assets) -> AsyncIterator[Service]:
    controller = make_controller(vllm_engine, tiny_assets)
    try:
        app = create_app(controller, Access(tokens=(TOKEN,)), header_timeout_s=2.0, body_timeout_s=2.0)
        async with serving(app, access_log=False) as url:
            # The store sits at DATA_DIR/store/<file>: the data directory tiny_assets was built in.
            store = tiny_assets.store.path
            yield Service(url, controller, vllm_engine, store.parent.parent, store)
    finally:
        await controller.close()


# ------------------------------------------------------------------------------------------ HTTP


@pytest.mark.parametrize("row", BAD_REQUESTS, ids=[row.name for row in BAD_REQUESTS])
async def test_a_malformed_request_gets_its_exact_4xx(service: Service, row: BadRequest) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        status, message = await send(http, service.url, row, TOKEN)
    assert (status, row.message in message) == (row.status, True), message


# ------------------------------------------------------------------------------------------ CLI


@dataclass(frozen=True)
class BadCommand:
    """A command line and the fragment of its one-line error (argparse's own for usage errors)."""

    name: str
    argv: tuple[str, ...]
    message: str


BAD_COMMANDS = (
    BadCommand("port too large", ("serve", "--port", "70000"), "--port must be between 0 and 65535"),
    BadCommand("negative port", ("serve", "--port", "-1"), "--port must be between 0 and 65535"),
    BadCommand("port not a number", ("serve", "--port", "http"), "invalid int value: 'http'"),
    BadCommand("unresolvable host", ("serve", "--host", "256.1.1.1", "--port", "0"), "cannot be bound"),
    BadCommand(
        "an address this machine lacks", ("serve", "--host", "192.0.2.1", "--port", "0"), "no such address"
    ),
    BadCommand(
        "negative shutdown timeout", ("serve", "--shutdown-timeout", "-1"), "--shutdown-timeout must be"
    ),
    BadCommand("zero stages", ("serve", "--stages", "0"), "--stages must be at least 1"),
    BadCommand(
        "zero prefill pool", ("serve", "--max-prefill-bs", "0"), "--max-prefill-bs must be at least 1"
    ),
    BadCommand("zero query limit", ("serve", "--max-queries", "0"), "--max-queries and --max-queries-per"),
    BadCommand("negative queue", ("serve", "--max-queue", "-1"), "--max-queue cannot be negative"),
    BadCommand(
        "no repetition penalty",
        ("serve", "--repetition-penalty", "0"),
        "--repetition-penalty must be greater than 0",
    ),
    BadCommand(
        "frequency penalty 3",
        ("serve", "--frequency-penalty", "3"),
        "--frequency-penalty must be between -2 and 2",
    ),
    BadCommand(
        "NaN first-token timeout", ("serve", "--first-token-timeout", "nan"), "--first-token-timeout must be"
    ),
    BadCommand("unset token variable", ("serve", "--api-token-env", "SPECRAG_NO_SUCH_VAR"), "is not set"),
    BadCommand("missing tokens file", ("serve", "--api-tokens-file", "{tmp}/none.txt"), "cannot read"),
    BadCommand("no token", ("serve", "--api-tokens-file", "{tmp}/no-tokens.txt"), "holds no token"),
    BadCommand("a token twice", ("serve", "--api-tokens-file", "{tmp}/twice.txt"), "holds a token twice"),
    BadCommand("unknown mode", ("serve", "--mode", "turbo"), "invalid choice: 'turbo'"),
    BadCommand(
        "KV events without an engine URL",
        ("serve", "--engine-kv-events", "tcp://127.0.0.1:5557"),
        "--engine-kv-events needs --engine-url",
    ),
    BadCommand(
        "KV events not over TCP",
        ("serve", "--engine-url", "http://127.0.0.1:1", "--engine-kv-events", "ipc:///tmp/kv"),
        "must look like tcp://HOST:PORT",
    ),
    BadCommand(
        "KV events port out of range",
        ("serve", "--engine-url", "http://127.0.0.1:1", "--engine-kv-events", "tcp://127.0.0.1:65535"),
        "(PORT 1..65534)",
    ),
    BadCommand("k above the limit", ("demo", "-k", "51"), "-k must be an integer between 1 and 50"),
    BadCommand("k not a number", ("demo", "-k", "ten"), "invalid int value: 'ten'"),
    BadCommand(
        "missing corpus file", ("index", "build", "--corpus", "{tmp}/none.jsonl"), "corpus file not found"
    ),
    BadCommand(
        "corpus not JSONL", ("index", "build", "--corpus", "{tmp}/bad.jsonl"), "bad.jsonl:1: not valid JSON"
    ),
    BadCommand(
        "Latin-1 corpus",
        ("index", "build", "--corpus", "{tmp}/latin1.jsonl"),
        "latin1.jsonl:2: not UTF-8 text",
    ),
    BadCommand("corpus is a directory", ("index", "build", "--corpus", "{tmp}"), "is a directory"),
    BadCommand("unknown index kind", ("index", "build", "--kind", "lsh"), "invalid choice: 'lsh'"),
    BadCommand(
        "PQ index of a small corpus",
        ("index", "build", "--kind", "ivf-pq"),
        "IVF-PQ needs at least 9984 vectors to train its codebooks",
    ),
    BadCommand("missing model dir", ("prepare", "--model", "{tmp}/no-model"), "model directory not found"),
)


@pytest.mark.parametrize("row", BAD_COMMANDS, ids=[row.name for row in BAD_COMMANDS])
def test_a_bad_command_line_exits_2_with_one_message(
    row: BadCommand, service: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad.jsonl").write_text("this is not json\n")
    (tmp_path / "no-tokens.txt").write_text("# no token yet\n\n")
    (tmp_path / "twice.txt").write_text("alice\nbob\nalice\n")
    (tmp_path / "latin1.jsonl").write_bytes(
        '{"id": 1, "text": "ok"}\n{"id": 2, "text": "café"}\n'.encode("latin-1")
    )
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in row.argv]
    # The built data directory: a row that gets past its argument checks finds a corpus there.
    try:
        status = main(["--data-dir", str(service.data_dir), *argv])
    except SystemExit as usage_error:  # argparse rejects before main's handler runs
        status = usage_error.code  # type: ignore[assignment]
    error = capsys.readouterr().err
    assert status == 2 and row.message in error, error
    assert "Traceback" not in error


def test_a_data_dir_that_is_a_file_exits_2_from_a_real_process(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    result = subprocess.run(
        [sys.executable, "-m", "specrag", "--data-dir", str(not_a_dir), "corpus", "build"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 2 and "Not a directory" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------------------------------ Python


@dataclass
class Context:
    service: Service
    tmp: Path


def _answer(**request: Any) -> Callable[[Context], Any]:
    def call(ctx: Context) -> Any:
        return ctx.service.controller.answer(RagRequest(**{"question": QUESTION, **request}))

    return call


async def _client_call(
    ctx: Context, call: Callable[[AsyncClient], Any], token: str = TOKEN, url: str | None = None
) -> Any:
    async with AsyncClient(url or ctx.service.url, api_token=token, timeout_s=60) as client:
        return await call(client)


async def _second_turn_while_one_runs(ctx: Context) -> Any:
    controller = ctx.service.controller
    session_id = controller.create_session("catalogue")
    running = controller.stream(
        RagRequest(QUESTION, k=4, max_tokens=200, session_id=session_id, client="catalogue")
    )
    try:
        await anext(running)  # the first turn is answering
        return await controller.answer(
            RagRequest(QUESTION, k=4, max_tokens=2, session_id=session_id, client="catalogue")
        )
    finally:
        await running.aclose()


def _corrupt_index(ctx: Context) -> Any:
    directory = ctx.tmp / "index"
    directory.mkdir()
    (directory / "manifest.json").write_text('{"format": "specrag-index", "version":')
    return load_index(directory)


def _truncated_store(ctx: Context) -> Any:
    copy = ctx.tmp / "store.sqlite"
    shutil.copyfile(ctx.service.store_file, copy)
    with copy.open("r+b") as handle:
        handle.truncate(copy.stat().st_size // 3)
    return DocumentStore(copy)


def _corpus(ctx: Context, text: str) -> Any:
    path = ctx.tmp / "corpus.jsonl"
    path.write_text(text)
    return load_passages(path)


@dataclass(frozen=True)
class BadCall:
    """A Python call and the exception (type and message fragment) it must raise."""

    name: str
    call: Callable[[Context], Any]
    error: type[BaseException]
    message: str


K_RANGE = "k must be an integer between 1 and 50"
BAD_CALLS = (
    BadCall("empty question", _answer(question=" \n"), InvalidInputError, "the question is empty"),
    BadCall("question is None", _answer(question=None), InvalidInputError, "the question is empty"),
    BadCall("lone surrogate", _answer(question="\udc80"), InvalidInputError, "not valid Unicode"),
    BadCall("k zero", _answer(k=0), InvalidInputError, K_RANGE),
    BadCall("k above k_max", _answer(k=51), InvalidInputError, K_RANGE),
    BadCall("k is True", _answer(k=True), InvalidInputError, K_RANGE),
    BadCall("k is a string", _answer(k="3"), InvalidInputError, K_RANGE),
    BadCall("k is a float", _answer(k=3.0), InvalidInputError, K_RANGE),
    BadCall("unknown mode", _answer(mode="turbo"), InvalidInputError, "unknown mode 'turbo'"),
    BadCall(
        "max_tokens a string", _answer(max_tokens="8"), InvalidInputError, "max_tokens must be an integer"
    ),
    BadCall("max_tokens over the limit", _answer(max_tokens=5000), InvalidInputError, "between 1 and 1024"),
    BadCall("unknown session", _answer(session_id="gone"), NotFoundError, "unknown session 'gone'"),
    BadCall("10,000-character session id", _answer(session_id="s" * 10_000), NotFoundError, "10,002 chara"),
    BadCall("k of 4,000 digits", _answer(k=10**3999), InvalidInputError, "an integer of more than 80 digits"),
    BadCall("second turn while one runs", _second_turn_while_one_runs, ConflictError, "turn in progress"),
    BadCall("temperature 5", _answer(temperature=5), InvalidInputError, "temperature must be between 0 and"),
    BadCall("temperature NaN", _answer(temperature=math.nan), InvalidInputError, "must be a finite number"),
    BadCall("temperature a string", _answer(temperature="hot"), InvalidInputError, "must be a number"),
    BadCall("top_p 0", _answer(top_p=0), InvalidInputError, "top_p must be greater than 0"),
    BadCall("seed True", _answer(seed=True), InvalidInputError, "seed must be an integer between 0"),
    BadCall("stop not strings", _answer(stop=[1]), InvalidInputError, "stop must be a string or a list"),
    BadCall(
        "prompt over the model limit",
        _answer(k=50, mode="serial"),
        InvalidInputError,
        "exceeds the model's limit",
    ),
    BadCall(
        "bad controller config",
        lambda ctx: ControllerConfig(k_default=0),
        InvalidInputError,
        "k_default must be between 1 and k_max",
    ),
    BadCall(
        "unknown stage schedule",
        lambda ctx: ControllerConfig(stage_schedule="front"),  # type: ignore[arg-type]
        InvalidInputError,
        "unknown stage schedule 'front'; choose one of equal, geometric",
    ),
    BadCall(
        "client timeout 0", lambda ctx: AsyncClient("http://x", timeout_s=0), ValueError, "must be positive"
    ),
    BadCall(
        "client: k out of range",
        lambda ctx: _client_call(ctx, lambda c: c.rag(QUESTION, k=0)),
        SpecragHTTPError,
        "HTTP 400 invalid_request_error: " + K_RANGE,
    ),
    BadCall(
        "client: unknown option",
        lambda ctx: _client_call(ctx, lambda c: c.stream_rag(QUESTION, top_p=0.5).__anext__()),
        SpecragHTTPError,
        "HTTP 400 invalid_request_error: unknown fields: top_p",
    ),
    BadCall(
        "client: close an unknown session",
        lambda ctx: _client_call(ctx, lambda c: c.close_session("a/b?c")),
        SpecragHTTPError,
        "HTTP 404 not_found_error",
    ),
    BadCall(
        "client: wrong token",
        lambda ctx: _client_call(ctx, lambda c: c.create_session(), token="wrong"),
        SpecragHTTPError,
        "HTTP 401 authentication_error",
    ),
    BadCall(
        "client: nobody listening",
        lambda ctx: _client_call(ctx, lambda c: c.health(), url=f"http://127.0.0.1:{free_port()}"),
        SpecragConnectionError,
        "GET /health",
    ),
    BadCall(
        "engine: no model", lambda ctx: EngineConfig(model="").validate(), InvalidInputError, "is required"
    ),
    BadCall(
        "engine: missing model dir",
        lambda ctx: EngineConfig(model=str(ctx.tmp / "none")).validate(),
        InvalidInputError,
        "model directory not found",
    ),
    BadCall(
        "engine: block size not a power of two",
        lambda ctx: EngineConfig(model=str(ctx.tmp), block_size=48).validate(),
        InvalidInputError,
        "block_size must be a power of two, got 48",
    ),
    BadCall(
        "engine: unknown dtype",
        lambda ctx: EngineConfig(model=str(ctx.tmp), dtype="int3").validate(),
        InvalidInputError,
        "dtype must be one of",
    ),
    BadCall(
        "corpus: missing file", lambda ctx: load_passages(ctx.tmp / "no.jsonl"), ArtifactError, "not found"
    ),
    BadCall(
        "corpus: duplicate ids",
        lambda ctx: _corpus(ctx, '{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n'),
        ArtifactError,
        "corpus.jsonl:2: duplicate id 'a'",
    ),
    BadCall(
        "corpus: empty text", lambda ctx: _corpus(ctx, '{"id": "a", "text": ""}\n'), ArtifactError, "'text'"
    ),
    BadCall("index: corrupt manifest", _corrupt_index, ArtifactError, "corrupt index manifest"),
    BadCall("store: truncated file", _truncated_store, ArtifactError, "store.sqlite"),
)


@pytest.mark.parametrize("row", BAD_CALLS, ids=[row.name for row in BAD_CALLS])
async def test_a_bad_python_call_raises_its_typed_error(
    row: BadCall, service: Service, tmp_path: Path
) -> None:
    with pytest.raises(row.error) as raised:
        result = row.call(Context(service, tmp_path))
        if inspect.isawaitable(result):
            await asyncio.wait_for(result, 60)  # bad input must fail, not hang
    assert row.message in str(raised.value)


# ------------------------------------------------------------------------------------------ after


async def test_after_the_catalogue_the_service_answers_and_nothing_is_left(service: Service) -> None:
    """Runs last (pytest keeps file order): every rejected request above is gone from the engine."""
    async with AsyncClient(service.url, api_token=TOKEN, timeout_s=120) as client:
        answer = await client.rag(QUESTION, k=4, max_tokens=4)
        assert answer.answer and len(answer.documents) == 4
        assert (await client.health())["status"] == "ok"
    for _ in range(100):
        counts = await service.engine.counts()
        if (
            not service.controller.in_flight_request_ids()
            and counts.running == counts.waiting == counts.unfinished == 0
        ):
            break
        await asyncio.sleep(0.05)
    assert service.controller.in_flight_request_ids() == set()
    counts = await service.engine.counts()
    assert (counts.running, counts.waiting, counts.unfinished) == (0, 0, 0)
    assert service.controller.gate.pool == 0
