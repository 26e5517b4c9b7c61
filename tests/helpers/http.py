"""Services the tests start and read: the HTTP service on a free port, vLLM's OpenAI server as
``specrag engine`` starts it, and the parsing of what they answer (Prometheus text, SSE)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from specrag.controller.controller import RagController
from specrag.pipeline.commands import engine_server_config
from specrag.service.http.access import Access
from specrag.service.http.app import create_app, serving

# The bearer token of the services the tests start.
TOKEN = "test-token-123"


def free_port() -> int:
    """A loopback port nobody listens on (free once the probe socket closes)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class EngineServer:
    """vLLM's OpenAI server started with the command ``specrag engine`` runs (so that command is
    what the tests exercise), in its own process group so that it can be killed whole and started
    again on the same ports."""

    def __init__(self, model_dir: Path, log_path: Path, kv_events_port: int | None = None) -> None:
        config = engine_server_config(str(model_dir), eager=True, kv_events_port=kv_events_port)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._command, environment = config.with_overrides(max_model_len=4096, kv_cache_gib=1).server_command(
            "127.0.0.1", self.port, on_cpu=True
        )
        self._environment = {
            **os.environ,
            **environment,
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_SERVER_DEV_MODE": "1",
        }
        self._log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, within_s: float = 240) -> None:
        """Start it and wait until ``/health`` answers 200."""
        with self._log_path.open("ab") as log:
            process = subprocess.Popen(
                self._command,
                env=self._environment,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._process = process
        deadline = time.monotonic() + within_s
        while not self.healthy():
            if process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self._log_path.read_text(errors="replace")[-3000:]
                raise AssertionError(f"vLLM server did not become healthy (exit {process.poll()}):\n{tail}")
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the server and its engine processes at once, as a crash would."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """Terminate it (killed after 30 s); safe to call twice."""
        self._signal(signal.SIGTERM)

    def _signal(self, signum: int) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            # A killed server's gigabytes of KV space take the kernel a while to free on a loaded
            # machine (a clean clone's suite beside a benchmark once needed more than 30 s).
            process.wait(timeout=120)


@contextlib.asynccontextmanager
async def running(
    controller: RagController, access: Access | None = None, **options: Any
) -> AsyncIterator[str]:
    """The service for ``controller`` on a free loopback port, closed (queries aborted) on exit;
    ``access`` and ``options`` are :func:`create_app`'s."""
    try:
        async with serving(create_app(controller, access or Access(), **options)) as url:
            yield url
    finally:
        await controller.close()


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text (0 when the series does not exist yet)."""
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    pattern = re.escape(name + (f"{{{wanted}}}" if labels else "")) + r" ([0-9.e+-]+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def sse_events(text: str) -> list[tuple[str, str]]:
    """``(event, data)`` pairs of a server-sent event body (event is "message" when unnamed)."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((fields.get("event", "message"), fields["data"]))
    return events
