"""The load the profile drives through HTTP, from a process of its own.

The client runs in a separate process so that its CPU is not the server's: the profile charges
every CPU second of the server process to a component. Two shapes of load: a closed loop of
``concurrency`` clients asking back to back (what the server holds at saturation), and open-loop
Poisson arrivals at a given rate (the first-token latency at a load it holds). Each answer is
streamed; its time to the first body chunk is its TTFT as a client sees it. Times are
``time.monotonic()``, one clock for every process of the machine, so the server can count the
answers that ended inside its profiled window.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp

__all__ = ["Load", "Timing", "running_load"]

REQUEST_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Load:
    """What to ask (``questions`` in turn) and how: closed loop when ``rate`` is None."""

    url: str
    questions: Sequence[str]
    body: dict[str, object]
    duration_s: float
    concurrency: int = 32
    rate: float | None = None
    seed: int = 0


@dataclass(frozen=True)
class Timing:
    """One answer: when it was sent, its first chunk and its end (monotonic seconds), and whether
    it succeeded (status 200 and a complete stream)."""

    sent: float
    first: float
    end: float
    ok: bool


async def _ask(session: aiohttp.ClientSession, load: Load, question: str) -> Timing:
    sent = time.monotonic()
    first = 0.0
    try:
        async with session.post(load.url, json={**load.body, "query": question, "stream": True}) as response:
            async for _ in response.content.iter_any():
                first = first or time.monotonic()
            ok = response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        ok = False
    end = time.monotonic()
    return Timing(sent, first or end, end, ok)


async def _drive(load: Load) -> list[Timing]:
    timings: list[Timing] = []
    rng = random.Random(load.seed)
    questions = iter(load.questions[i % len(load.questions)] for i in range(10**9))
    stop_at = time.monotonic() + load.duration_s
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if load.rate is None:

            async def client() -> None:
                while time.monotonic() < stop_at:
                    timings.append(await _ask(session, load, next(questions)))

            await asyncio.gather(*(client() for _ in range(load.concurrency)))
            return timings
        tasks: list[asyncio.Task[Timing]] = []
        due = time.monotonic()
        while due < stop_at:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.create_task(_ask(session, load, next(questions))))
            due += rng.expovariate(load.rate)
        return list(await asyncio.gather(*tasks))


@contextlib.asynccontextmanager
async def running_load(load: Load) -> AsyncIterator[asyncio.Future[list[Timing]]]:
    """Start ``load`` in a fresh process (this module run as a script, which imports nothing of
    the server) and enter once it runs; the future is its timings, at its end. The process is
    killed if the block fails."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", __name__, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        process.stdin.write(json.dumps(dataclasses.asdict(load)).encode() + b"\n")
        process.stdin.close()
        ready = await asyncio.wait_for(process.stdout.readline(), timeout=60)
        if ready.strip() != b"ready":
            raise RuntimeError(f"the load process did not start: {ready!r}")

        async def timings() -> list[Timing]:
            assert process.stdout is not None
            output = await asyncio.wait_for(
                process.stdout.read(), timeout=load.duration_s + 2 * REQUEST_TIMEOUT_S
            )
            await process.wait()
            return [Timing(*row) for row in json.loads(output)]

        yield asyncio.ensure_future(timings())
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


def _main() -> None:
    load = Load(**json.loads(sys.stdin.readline()))
    print("ready", flush=True)
    timings = asyncio.run(_drive(load))
    print(json.dumps([dataclasses.astuple(t) for t in timings]), flush=True)


if __name__ == "__main__":
    _main()
