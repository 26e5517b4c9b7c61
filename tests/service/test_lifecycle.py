"""Bind first, say what is starting, hand over, stop on a signal: the service's life, no engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from specrag.errors import InvalidInputError
from specrag.service.run.lifecycle import serve_until_signalled
from specrag.service.run.startup import (
    STARTING_RETRY_AFTER_S,
    Phase,
    StartupProgress,
    bind_listener,
)

# TEST-NET-1 (RFC 5737): documentation only, never an address of this machine.
FOREIGN_ADDRESS = "192.0.2.1"


def test_a_busy_port_is_refused_at_once() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(InvalidInputError, match=f"--port {port}: .* already in use"):
            bind_listener("127.0.0.1", port)


def test_an_address_the_machine_lacks_is_refused_at_once() -> None:
    with pytest.raises(InvalidInputError, match="no such address"):
        bind_listener(FOREIGN_ADDRESS, 0)


def test_the_phases_are_timed_and_shown() -> None:
    progress = StartupProgress()
    progress.begin(Phase.ARTEFACTS)
    progress.end(Phase.ARTEFACTS)
    progress.record(Phase.ENGINE_LOAD, 10.0)
    assert progress.to_dict()["ready_s"] is None
    progress.ready()
    shown = progress.to_dict()
    assert shown["phase"] == "started" and shown["ready_s"] >= 0
    assert shown["phases_s"]["engine_load"] == 10.0 and shown["phases_s"]["artefacts"] >= 0


@dataclass
class FakeService:
    """What serve_until_signalled needs of a service: its application and begin_shutdown."""

    app: web.Application = field(default_factory=web.Application)
    stopping: bool = False

    def __post_init__(self) -> None:
        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        self.app.router.add_get("/health", health)

    def begin_shutdown(self) -> None:
        self.stopping = True


async def status_of(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, object], str | None]:
    async with session.get(url) as response:
        return response.status, await response.json(), response.headers.get("Retry-After")


async def test_the_port_answers_503_while_starting_then_the_service_takes_over_until_a_signal() -> None:
    listener = bind_listener("127.0.0.1", 0)
    base = f"http://127.0.0.1:{listener.getsockname()[1]}"
    proceed, said = asyncio.Event(), asyncio.Queue[str]()
    service = FakeService()
    progress = StartupProgress()

    @contextlib.asynccontextmanager
    async def start() -> AsyncIterator[FakeService]:
        progress.begin(Phase.ENGINE_LOAD)
        await proceed.wait()  # the engine's minutes
        progress.end(Phase.ENGINE_LOAD)
        yield service

    with contextlib.closing(listener):
        serving = asyncio.create_task(
            serve_until_signalled(
                listener,
                progress,
                start,
                shutdown_timeout_s=1.0,
                announce=said.put_nowait,
            )
        )
        async with aiohttp.ClientSession() as session:
            assert (await said.get()).startswith("specrag listening on")
            status, body, _ = await status_of(session, f"{base}/health")
            assert status == 503 and body["status"] == "starting"
            assert body["startup"]["phase"] == "engine_load"  # type: ignore[index]
            status, body, retry_after = await status_of(session, f"{base}/v1/models")
            assert status == 503 and retry_after == str(int(STARTING_RETRY_AFTER_S))
            assert body["error"]["code"] == "starting"  # type: ignore[index]
            proceed.set()
            assert (await asyncio.wait_for(said.get(), 10)).startswith("specrag serving on")
            status, body, _ = await status_of(session, f"{base}/health")
            assert (status, body) == (200, {"status": "ok"})
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(serving, 10)
    assert service.stopping and (await said.get()).startswith("stopping")
    assert progress.durations_s[Phase.ENGINE_LOAD] >= 0


def test_serve_on_a_busy_port_exits_within_seconds(tmp_path: Path) -> None:
    """Before the artefacts or the engine: today's serve found a busy port only once the engine
    had started, minutes later."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        started = time.monotonic()
        command = [sys.executable, "-m", "specrag", "--data-dir", str(tmp_path / "data"), "serve"]
        result = subprocess.run(
            [*command, "--port", port], capture_output=True, text=True, timeout=60, check=False
        )
    assert time.monotonic() - started < 10
    assert result.returncode == 2 and "already in use" in result.stderr
    assert not (tmp_path / "data").exists()  # nothing built
