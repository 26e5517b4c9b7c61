"""The embedding stand-in (``python -m specrag.sim.embedding_server``) for the configuration
"embedding served elsewhere": the benchmark's questions embedded before it serves, so that while
the fronts are measured it spends no CPU on the model, only on its HTTP answers."""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import sys
import tempfile
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil

from bench.capacity.replicas import stop_process
from specrag.retrieval.text import normalize_text
from specrag.service.run.pinning import pin_threads
from specrag.service.run.pools import free_port_pair

__all__ = ["EmbeddingServer", "running_embedding_server"]

# It embeds every distinct question alone first: a minute or more on a loaded 2-core machine.
START_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class EmbeddingServer:
    url: str

    async def stats(self) -> dict[str, int]:
        """Batches, texts, and texts it had to compute while serving (a front's start asks it to
        embed a probe text for its dimension)."""
        async with aiohttp.ClientSession() as session, session.get(f"{self.url}/standin/stats") as response:
            response.raise_for_status()
            stats: dict[str, int] = await response.json()
            return stats


@contextlib.contextmanager
def running_embedding_server(
    questions: Sequence[str], cpus: Collection[int] | None
) -> Iterator[EmbeddingServer]:
    """The stand-in with ``questions`` embedded as the service embeds them (normalised), pinned to
    ``cpus`` once it serves; stopped on exit."""
    texts = sorted({normalize_text(question) for question in questions})
    with tempfile.TemporaryDirectory(prefix="capacity-embedding-") as scratch:
        listed = Path(scratch) / "questions.json"
        listed.write_text(json.dumps(texts), encoding="utf-8")
        port = free_port_pair()
        command = [sys.executable, "-m", "specrag.sim.embedding_server", "--port", str(port)]
        process = subprocess.Popen(
            [*command, "--precompute", str(listed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert process.stdout is not None
            readable, _, _ = select.select([process.stdout], [], [], START_TIMEOUT_S)
            line = process.stdout.readline() if readable else "(nothing within the start timeout)"
            if "embedding stand-in on" not in line:
                raise RuntimeError(f"the embedding stand-in did not start (exit {process.poll()}): {line!r}")
            if cpus:
                pin_threads(psutil.Process(process.pid), cpus)
            print(f"embedding stand-in ready: {len(texts)} questions embedded before measuring", flush=True)
            yield EmbeddingServer(f"http://127.0.0.1:{port}")
        finally:
            stop_process(process)
