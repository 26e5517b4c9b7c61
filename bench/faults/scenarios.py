"""bench.faults' scenarios against the real service: faults, overload, disconnects, bad input, soak."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import engine_cores
from bench.faults.inputs import BAD_REQUESTS, QUESTION, send
from bench.faults.outcomes import (
    CLIENT_LEFT,
    ERROR_BOUND_S,
    FIRST_TOKEN_TIMEOUT_S,
    QUESTIONS,
    RECOVERY_BOUND_S,
    TOKEN,
    Outcome,
    Run,
)
from specrag.client import (
    AsyncClient,
    SpecragConnectionError,
    SpecragHTTPError,
    SpecragTimeoutError,
)
from specrag.controller.controller import ControllerConfig
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.supervisor import SupervisorPolicy
from specrag.pipeline.models.random_model import RANDOM_MODEL_NAME
from specrag.service.http.access import Access
from specrag.service.http.app import create_app, serving
from specrag.service.run.assembly import Service, ServiceOptions, open_service
from specrag.service.run.assets import Assets, ensure_assets

# ---------------------------------------------------------------------------------------- engine core


def only_engine_core() -> int:
    cores = engine_cores()
    if len(cores) != 1 or cores[0].pid is None:
        raise RuntimeError(f"expected one engine core process, found {[c.name for c in cores]}")
    return cores[0].pid


def is_zombie(pid: int) -> bool:
    """A process that has exited but was not yet reaped: signals still reach it, nothing runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def kill_leftover(pids: set[int]) -> int:
    """SIGCONT then SIGKILL every process we stopped or that is still an engine core; how many lived."""
    alive = 0
    for pid in pids | {core.pid for core in engine_cores() if core.pid is not None}:
        if is_zombie(pid):
            continue  # already gone; join() below reaps our own children
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
            alive += 1
    for core in engine_cores():
        core.join(timeout=10)
    return alive


# ---------------------------------------------------------------------------------------- traffic


async def one_query(client: AsyncClient, run: Run, scenario: str, number: int, stream: bool) -> Outcome:
    """A query through the Python client, its outcome recorded."""
    started = run.now()
    status, note = 200, ""
    question = QUESTIONS[number % len(QUESTIONS)]
    try:
        if stream:
            async with client.stream_rag(question, k=4, max_tokens=8) as answer:
                async for _ in answer:
                    pass
        else:
            await client.rag(question, k=4, max_tokens=8)
    except SpecragHTTPError as error:
        status, note = error.status, error.message[:120]
    except (SpecragConnectionError, SpecragTimeoutError) as error:
        status, note = 0, str(error)[:120]
    outcome = Outcome(scenario, started, run.now() - started, status, note)
    run.outcomes.append(outcome)
    return outcome


async def load(client: AsyncClient, run: Run, scenario: str, stop: asyncio.Event, clients: int) -> None:
    """``clients`` callers asking back to back until ``stop``; after an error they pause briefly."""

    async def caller(index: int) -> None:
        number = index
        while not stop.is_set():
            outcome = await one_query(client, run, scenario, number, stream=number % 2 == 0)
            number += clients
            if outcome.status != 200:
                await asyncio.sleep(0.5)  # a polite client backs off (Retry-After says 1-5 s)

    await asyncio.gather(*(caller(index) for index in range(clients)))


async def watch_health(url: str, run: Run, stop: asyncio.Event) -> None:
    """Poll /health all along: no answer within 10 s (or a refused connection) is a crash."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        while not stop.is_set():
            try:
                async with http.get(f"{url}/health") as response:
                    await response.read()
            except (aiohttp.ClientError, TimeoutError):
                run.health_failures += 1
            await asyncio.sleep(0.5)


# What a run that does not recover reports of the last /health.
HEALTH_SEEN = ("status", "engine_state", "engine_restarts", "prefill_pool", "queued", "in_flight_queries")


async def wait_recovered(client: AsyncClient, service: Service, restarts_before: int, run: Run) -> float:
    """Seconds until /health is 200 on a replacement engine and a query succeeds (bounded); past
    the bound, the error says what /health and the last query said (a full prefill pool and queue
    read differently from an engine that never came back)."""
    deadline = time.perf_counter() + RECOVERY_BOUND_S
    health: dict[str, Any] = {}
    last_error: Exception | None = None
    while time.perf_counter() < deadline:
        try:
            health = await client.health()
            if health.get("status") == "ok" and health.get("engine_restarts", 0) > restarts_before:
                await client.rag(QUESTION, k=4, max_tokens=4)
                return run.now()
        except (SpecragHTTPError, SpecragConnectionError, SpecragTimeoutError) as error:
            last_error = error
        await asyncio.sleep(0.25)
    seen = ", ".join(f"{key} {health.get(key)}" for key in HEALTH_SEEN)
    raise RuntimeError(
        f"the service did not recover within {RECOVERY_BOUND_S:.0f} s (last /health: {seen}; "
        f"last error: {last_error})"
    )


async def fault_scenario(
    name: str, inject: Callable[[int], None], service: Service, client: AsyncClient, run: Run, clients: int
) -> None:
    """Load, inject the fault into the engine core, wait for recovery, keep the load a little longer."""
    stop = asyncio.Event()
    traffic = asyncio.create_task(load(client, run, name, stop, clients))
    try:
        await asyncio.sleep(3.0)
        restarts = service.supervised_engine().restarts
        pid = only_engine_core()
        fault_at = run.now()
        inject(pid)
        run.faults.append({"scenario": name, "at_s": fault_at, "pid": pid})
        recovered_at = await wait_recovered(client, service, restarts, run)
        run.recoveries[name] = recovered_at - fault_at
        run.faults[-1]["recovered_at_s"] = recovered_at
        await asyncio.sleep(2.0)
    finally:
        stop.set()
        await asyncio.wait_for(traffic, ERROR_BOUND_S)


# ---------------------------------------------------------------------------------------- scenarios


async def overload(service: Service, url: str, client: AsyncClient, run: Run, burst: int) -> None:
    """Bursts past each admission limit; 429s must carry Retry-After."""
    limited = {
        "max_queries": create_app(service.controller, Access(tokens=(TOKEN,), max_queries=3)),
        "max_queries_per_client": create_app(
            service.controller, Access(tokens=(TOKEN,), max_queries_per_client=2)
        ),
    }
    report: dict[str, Any] = {}

    async def burst_on(label: str, base: str) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=300)) as http:

            async def ask(number: int) -> tuple[int, float, str | None, str]:
                started = run.now()
                body = {"query": QUESTIONS[number % len(QUESTIONS)], "k": 4, "max_tokens": 8}
                async with http.post(f"{base}/v1/rag", json=body) as response:
                    text = await response.text()
                latency = run.now() - started
                run.outcomes.append(Outcome(f"overload:{label}", started, latency, response.status))
                message = (
                    json.loads(text).get("error", {}).get("message", "") if response.status != 200 else ""
                )
                return response.status, latency, response.headers.get("Retry-After"), message

            results = await asyncio.gather(*(ask(number) for number in range(burst)))
        admitted = sorted(latency for status, latency, _, _ in results if status == 200)
        rejected = [(retry, message) for status, _, retry, message in results if status == 429]
        report[label] = {
            "sent": burst,
            "statuses": dict(Counter(status for status, *_ in results)),
            "rejected_without_retry_after": sum(1 for retry, _ in rejected if not retry),
            "rejection_message": rejected[0][1] if rejected else None,
            "admitted_p50_s": statistics.median(admitted) if admitted else None,
            "admitted_p99_s": admitted[min(len(admitted) - 1, round(0.99 * (len(admitted) - 1)))]
            if admitted
            else None,
        }

    await burst_on("max_queue", url)  # the service's own app: the controller's queue limit
    for label, app in limited.items():
        async with serving(app, access_log=False) as base:
            await burst_on(label, base)
    run.overload = report


async def disconnects(
    url: str, client: AsyncClient, run: Run, count: int, scenario: str = "disconnect"
) -> None:
    """Clients that leave mid-stream (after the first delta) or mid-wait (before any answer)."""

    async def leave_mid_stream(number: int) -> None:
        started = run.now()
        async with client.stream_rag(QUESTIONS[number % len(QUESTIONS)], k=4, max_tokens=200) as answer:
            with contextlib.suppress(SpecragHTTPError, StopAsyncIteration):
                await anext(answer)
        run.outcomes.append(Outcome(scenario, started, run.now() - started, CLIENT_LEFT, "mid-stream"))

    async def leave_mid_wait(number: int) -> None:
        started = run.now()
        call = asyncio.create_task(client.rag(QUESTIONS[number % len(QUESTIONS)], k=6, max_tokens=64))
        await asyncio.sleep(0.05 + 0.1 * (number % 5))
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        run.outcomes.append(Outcome(scenario, started, run.now() - started, CLIENT_LEFT, "mid-wait"))

    await asyncio.gather(*(leave_mid_stream(n) for n in range(count // 2)))
    await asyncio.gather(*(leave_mid_wait(n) for n in range(count - count // 2)))


async def soak(url: str, client: AsyncClient, run: Run, duration_s: float, clients: int) -> None:
    """Back-to-back callers and waves of leaving clients on the real engine, for ``duration_s``."""
    stop = asyncio.Event()

    async def leavers() -> None:
        while not stop.is_set():
            await disconnects(url, client, run, 4, scenario="soak disconnect")

    async def timer() -> None:
        await asyncio.sleep(duration_s)
        stop.set()

    await asyncio.gather(load(client, run, "soak", stop, clients), leavers(), timer())


async def bad_inputs(url: str, run: Run) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for row in BAD_REQUESTS:
            started = run.now()
            status, message = await send(http, url, row, TOKEN)
            run.outcomes.append(Outcome("bad input", started, run.now() - started, status, row.name))
            run.bad_inputs.append(
                {
                    "name": row.name,
                    "expected": row.status,
                    "status": status,
                    "ok": status == row.status and row.message in message,
                }
            )


async def settle(service: Service, run: Run, within_s: float = 30.0) -> None:
    """Wait (bounded) for the engine's own queues and the controller to drain; record what is left."""
    deadline = time.perf_counter() + within_s
    while True:
        counts = await service.supervised_engine().counts()
        in_flight = service.controller.in_flight_request_ids()
        # Every state a request can be left in; one request may count twice (running and
        # unfinished), which is fine: only zero means "nothing left".
        left = counts.running + counts.waiting + counts.unfinished + len(in_flight)
        if left == 0 or time.perf_counter() > deadline:
            run.leaks = {**asdict(counts), "controller_in_flight": len(in_flight), "leaked": left}
            return
        await asyncio.sleep(0.2)


# ---------------------------------------------------------------------------------------- the run


@contextlib.asynccontextmanager
async def real_service(assets: Assets, run_dir: Path) -> AsyncIterator[tuple[Service, str]]:
    options = ServiceOptions(
        controller=ControllerConfig(first_token_timeout_s=FIRST_TOKEN_TIMEOUT_S, max_queue=6),
        eager=True,
        access=Access(tokens=(TOKEN,)),
        supervisor=SupervisorPolicy(probe_timeout_s=3.0, close_timeout_s=20.0, backoff_s=1.0),
    )
    async with (
        open_service(assets, options, run_dir) as service,
        serving(service.app, access_log=False) as url,
    ):
        yield service, url


async def run_all(args: argparse.Namespace, run: Run, stopped: set[int]) -> None:
    assets = ensure_assets(DataLayout(resolve_data_dir()), RANDOM_MODEL_NAME)
    with tempfile.TemporaryDirectory(prefix="specrag-faults-") as run_dir:
        started = time.perf_counter()
        async with real_service(assets, Path(run_dir)) as (service, url):
            print(f"service on {url} (engine started in {time.perf_counter() - started:.0f} s)", flush=True)
            health_stop = asyncio.Event()
            health = asyncio.create_task(watch_health(url, run, health_stop))
            try:
                async with AsyncClient(url, api_token=TOKEN, timeout_s=ERROR_BOUND_S) as client:
                    run.step = "the first query"
                    await client.rag(QUESTION, k=4, max_tokens=4)  # warm: compile paths, fill the cache
                    run.begin("(e) bad inputs")
                    await bad_inputs(url, run)
                    run.begin("(c) overload")
                    await overload(service, url, client, run, burst=args.burst)
                    run.begin("(d) disconnects")
                    await disconnects(url, client, run, args.disconnects)
                    await settle(service, run)
                    disconnect_leaks = dict(run.leaks)
                    run.begin(f"(f) soak with disconnects for {args.soak_s:.0f} s")
                    await soak(url, client, run, args.soak_s, args.clients)
                    await settle(service, run)
                    soak_leaks = dict(run.leaks)
                    run.begin("(a) kill the engine core")
                    await fault_scenario(
                        "kill", lambda pid: os.kill(pid, signal.SIGKILL), service, client, run, args.clients
                    )

                    def hang(pid: int) -> None:
                        stopped.add(pid)
                        os.kill(pid, signal.SIGSTOP)

                    run.begin("(b) hang the engine core")
                    await fault_scenario("hang", hang, service, client, run, args.clients)
                    await settle(service, run)
                    run.leaks["after_disconnects"] = disconnect_leaks
                    run.leaks["after_soak"] = soak_leaks
                run.begin("stopping the service")
            finally:  # a failed scenario too: polling a service that stops is no crash of it
                health_stop.set()
                await health
