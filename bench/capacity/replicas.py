"""Stand-in replicas (``python -m specrag.sim.gpu_server``), one process each, for a capacity run."""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import aiohttp
import psutil

from specrag.service.run.pinning import pin_threads
from specrag.service.run.pools import free_port_pair

__all__ = ["StandIn", "running_stand_ins", "stop_process"]

START_TIMEOUT_S = 600.0  # each imports vLLM's modules: minutes on a loaded 2-core machine


@dataclass
class StandIn:
    """One running replica: its HTTP URL and KV-event endpoint (replays on the next port)."""

    process: subprocess.Popen[str]
    url: str
    kv_events: str

    async def records(self, session: aiohttp.ClientSession) -> dict[str, dict[str, object]]:
        """Each request it finished since the last call, by request id (and forgets them)."""
        async with session.get(f"{self.url}/standin/requests", params={"clear": "1"}) as response:
            response.raise_for_status()
            body = await response.json()
        return {record["request_id"]: record for record in body["requests"]}

    async def published_events(self, session: aiohttp.ClientSession) -> int:
        async with session.get(f"{self.url}/metrics") as response:
            text = await response.text()
        for line in text.splitlines():
            if line.startswith("specrag_standin_kv_events_total"):
                return int(float(line.split()[-1]))
        return 0

    async def reset_prefix_cache(self, session: aiohttp.ClientSession) -> bool:
        async with session.post(f"{self.url}/reset_prefix_cache") as response:
            return bool((await response.json())["success"])


def _start() -> StandIn:
    port, events_port = free_port_pair(), free_port_pair()
    command = [sys.executable, "-m", "specrag.sim.gpu_server", "--port", str(port)]
    command += ["--kv-events-port", str(events_port)]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    return StandIn(process, f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events_port}")


def _wait_ready(stand_in: StandIn) -> None:
    assert stand_in.process.stdout is not None
    readable, _, _ = select.select([stand_in.process.stdout], [], [], START_TIMEOUT_S)
    line = stand_in.process.stdout.readline() if readable else "(nothing within the start timeout)"
    if "GPU stand-in on" not in line:
        raise RuntimeError(f"a stand-in did not start (exit {stand_in.process.poll()}): {line!r}")


def stop_process(process: subprocess.Popen[str], timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not ended within ``timeout_s``; reaped either way."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def running_stand_ins(count: int, cpus: Collection[int] | None) -> Iterator[list[StandIn]]:
    """``count`` stand-ins started together on every core, then pinned (all their threads) to
    ``cpus`` once serving; stopped on exit."""
    stand_ins: list[StandIn] = []
    try:
        stand_ins = [_start() for _ in range(count)]
        for stand_in in stand_ins:
            _wait_ready(stand_in)
            if cpus:
                pin_threads(psutil.Process(stand_in.process.pid), cpus)
        yield stand_ins
    finally:
        for stand_in in stand_ins:
            stop_process(stand_in.process)
