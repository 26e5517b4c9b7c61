"""What the service shows to whom: a bad Authorization header is a 401, /health without a token
says only ready or not, ``serve`` warns when it listens beyond loopback without a token, and an
engine server's KV events stay on loopback unless told otherwise."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from bench.faults.inputs import send_wire
from specrag.cli import main
from specrag.controller.controller import RagController
from specrag.service.http.access import Access
from specrag.service.http.app import create_app, serving
from specrag.service.run.assets import Assets
from specrag.service.run.exposure import beyond_loopback
from tests.helpers.builders import A, make_controller, scripted_index
from tests.helpers.engines import StandInSupervision, SupervisedSimulation
from tests.helpers.http import free_port

TOKEN = "exposure-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest_asyncio.fixture(loop_scope="session")
async def service(tiny_assets: Assets) -> AsyncIterator[tuple[str, RagController, SupervisedSimulation]]:
    engine = SupervisedSimulation(StandInSupervision())
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A, A], 0.01))
    try:
        async with serving(create_app(controller, Access(tokens=(TOKEN,))), access_log=False) as url:
            yield url, controller, engine
    finally:
        await controller.close()
        await engine.close()


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe\xfd", b"\xc3\x28", b"Bearer exposure-token\xff"])
@pytest.mark.parametrize("path", [b"/metrics", b"/health"])
async def test_a_header_that_is_not_utf8_is_a_401_and_logs_no_error(
    service: tuple[str, RagController, SupervisedSimulation],
    value: bytes,
    path: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = service[0]
    request = (
        b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: " + value + b"\r\nConnection: close\r\n\r\n"
    )
    status, message = await send_wire(url, request, within_s=10)
    if path == b"/health":  # open, but to an unauthenticated caller it says only ready or not
        assert status == 200 and message == '{"status": "ok"}'
    else:
        assert (status, message) == (401, "missing or wrong bearer token")
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


async def test_health_without_a_token_says_only_ready_or_not(
    service: tuple[str, RagController, SupervisedSimulation],
) -> None:
    url, _, engine = service
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/health") as response:
            assert (response.status, await response.json()) == (200, {"status": "ok"})
        async with http.get(f"{url}/health", headers={"Authorization": "Bearer wrong"}) as response:
            assert (response.status, await response.json()) == (200, {"status": "ok"})
        async with http.get(f"{url}/health", headers=AUTH) as response:
            full = await response.json()
        assert full["engine_restarts"] == 3 and full["replicas"]
        await engine.die()
        async with http.get(f"{url}/health") as response:
            assert (response.status, await response.json()) == (503, {"status": "unavailable"})
        async with http.get(f"{url}/health", headers=AUTH) as response:
            assert response.status == 503
            assert "died" in (await response.json())["reason"]  # the operator still sees why


@pytest.mark.parametrize(
    ("host", "token", "warned"),
    [
        ("0.0.0.0", None, True),
        ("127.0.0.1", None, False),
        ("0.0.0.0", "T", False),
        ("localhost", None, False),
    ],
)
def test_serve_warns_when_it_listens_beyond_loopback_without_a_token(
    host: str,
    token: str | None,
    warned: bool,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The warning comes before anything starts (a bad setting after it stops the command here)."""
    caplog.set_level(logging.WARNING)
    options = []
    if token is not None:
        monkeypatch.setenv("EXPOSURE_TOKEN", token)
        options = ["--api-token-env", "EXPOSURE_TOKEN"]
    argv = ["serve", "--host", host, "--port", "0", *options, "--inter-token-timeout", "0"]
    assert main(["--data-dir", str(tmp_path), *argv]) == 2
    assert "--inter-token-timeout must be positive" in capsys.readouterr().err
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "API token" in r.getMessage()
    ]
    assert bool(warnings) is warned
    assert all("Document writes (PUT, POST, DELETE /v1/documents)" in warning for warning in warnings)
    assert all("--writer-tokens-file" in warning for warning in warnings)
    assert beyond_loopback(host) is (host == "0.0.0.0")


def test_an_engine_server_s_kv_events_bind_loopback_unless_told(tmp_path: Path) -> None:
    """``specrag engine --host 0.0.0.0`` serves on every interface; its KV events (every prompt's
    token ids) stay on loopback unless ``--kv-events-host`` says otherwise."""
    port = free_port()

    def printed(*options: str) -> str:
        argv = ["engine", "--model", str(tmp_path), "--host", "0.0.0.0", "--kv-events-port", str(port)]
        result = subprocess.run(
            [sys.executable, "-m", "specrag", *argv, *options, "--print"],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        return result.stdout

    default, told = printed(), printed("--kv-events-host", "0.0.0.0")
    assert f"[::ffff:127.0.0.1]:{port}" in default and f"*:{port}" not in default
    assert f"*:{port}" in told


def test_writer_tokens_alone_count_as_tokens_for_the_exposure_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Writer tokens alone make every endpoint but /health need a token: no warning then."""
    caplog.set_level(logging.WARNING)
    writers = tmp_path / "writers.txt"
    writers.write_text("a-writer-token\n")
    argv = ["serve", "--host", "0.0.0.0", "--port", "0", "--writer-tokens-file", str(writers)]
    assert main(["--data-dir", str(tmp_path), *argv, "--inter-token-timeout", "0"]) == 2
    assert not [record for record in caplog.records if "API token" in record.getMessage()]
