"""Reliability of the real service under faults, overload, disconnects and bad input.

Rerun: ``.venv/bin/python -m bench.faults --quick`` (about 5 minutes here) or without ``--quick``
(longer loads, more disconnects). It starts the embedded default service (in-process vLLM,
``enforce_eager`` for a faster start) on a loopback port and, driving it over HTTP:

a. kills the vLLM engine core (SIGKILL) mid-load: every affected query must get a clear error
   (502/503/504) or be retried, the supervisor must restart the engine; recovery is the time from
   the kill to ``/health`` 200 on a new engine and a successful query;
b. stops the engine core (SIGSTOP) mid-load: queries must hit the first-token timeout (504) or
   fail fast (503) while the supervisor replaces the engine; recovery is measured the same way;
c. overloads it past ``max_queries``, ``max_queries_per_client`` and the controller's
   ``max_queue``: the excess gets 429 with Retry-After, the admitted queries' p99 is reported;
d. opens streams and drops them mid-answer or mid-wait: nothing may be left in the engine;
e. sends the catalogue of malformed requests in :mod:`bench.faults.inputs`: each must get its 4xx;
f. soaks it for a bounded time (``--soak-s``): callers back to back while others keep leaving
   mid-stream and mid-wait; afterwards no engine request may be left in any state.

A 5xx other than the documented engine errors (502 engine error, 503 engine recovering, 504 no
first token in time) counts as a server error. A leak is any engine request still running,
waiting or unfinished in the engine's own counts, or still held by the controller, after the
service settled.

Output: bench/out/faults.json, faults.png (request outcomes over time around the faults, recovery
times), a table on the terminal and, as the last line, a JSON summary. The summary is printed
whatever happens, also when a scenario fails, the engine does not come back or the run is
interrupted: ``failure`` then names the scenario and the error, ``checks`` says which checks held,
and the exit status is 0 only when every one held and nothing failed. Every engine-core process
is gone at the end, a stopped one included, even when the run fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import engine_cores, machine, plot_path, save_figure, stop_cleanly_on_sigterm, write_json
from bench.faults.inputs import BAD_REQUESTS, QUESTION, send
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

TOKEN = "bench-faults-token"
# The outcome of a request its client abandoned on purpose (nginx's "client closed request").
CLIENT_LEFT = 499
FIRST_TOKEN_TIMEOUT_S = 5.0
# How long a fault may take to be answered or recovered from before the run counts it as a hang.
ERROR_BOUND_S = 60.0
RECOVERY_BOUND_S = 240.0
QUESTIONS = (
    QUESTION,
    "How does asyncio.run create and close the event loop?",
    "What is a generator expression?",
    "How are exceptions chained with raise from?",
    "What does the with statement guarantee?",
    "How do I open a file for appending?",
)


@dataclass
class Outcome:
    """One request as the client saw it; ``status`` 0 means the connection broke or timed out."""

    scenario: str
    started_s: float
    latency_s: float
    status: int
    note: str = ""


@dataclass
class Run:
    """Everything measured, relative to ``t0``."""

    t0: float = field(default_factory=time.perf_counter)
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    recoveries: dict[str, float] = field(default_factory=dict)
    health_failures: int = 0
    bad_inputs: list[dict[str, Any]] = field(default_factory=list)
    overload: dict[str, Any] = field(default_factory=dict)
    leaks: dict[str, Any] = field(default_factory=dict)
    step: str = "starting the service"
    """The scenario under way: what a failure happened in."""

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def begin(self, step: str) -> None:
        self.step = step
        print(step, flush=True)


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


async def wait_recovered(client: AsyncClient, service: Service, restarts_before: int, run: Run) -> float:
    """Seconds until /health is 200 on a replacement engine and a query succeeds (bounded)."""
    deadline = time.perf_counter() + RECOVERY_BOUND_S
    while time.perf_counter() < deadline:
        with contextlib.suppress(SpecragHTTPError, SpecragConnectionError, SpecragTimeoutError):
            health = await client.health()
            if health.get("status") == "ok" and health.get("engine_restarts", 0) > restarts_before:
                await client.rag(QUESTION, k=4, max_tokens=4)
                return run.now()
        await asyncio.sleep(0.25)
    raise RuntimeError(f"the service did not recover within {RECOVERY_BOUND_S:.0f} s")


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


# ---------------------------------------------------------------------------------------- main


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
            health_stop.set()
            await health


ENGINE_ERROR_STATUSES = (502, 503, 504)
"""The documented engine errors: 502 the engine failed, 503 it is recovering, 504 no first token."""


FAULTS = ("kill", "hang")
OVERLOAD_LIMITS = ("max_queue", "max_queries", "max_queries_per_client")
# The settles recorded beside the last one (run.leaks itself).
_SETTLED = ("after_disconnects", "after_soak")


def is_server_error(status: int) -> bool:
    """A 5xx that is not a documented engine error: the service itself failed."""
    return 500 <= status < 600 and status not in ENGINE_ERROR_STATUSES


def summarize(run: Run, leftover_processes: int, failure: str | None = None) -> dict[str, Any]:
    """What the run measured, which checks held, and ``failure`` (what stopped it, or None).

    Everything is read as measured so far, so that a run that failed half way still says what
    it saw; a check whose scenario never ran does not hold.
    """
    statuses = Counter(outcome.status for outcome in run.outcomes)
    fault_errors = [o for o in run.outcomes if o.scenario in ("kill", "hang") and o.status != 200]
    soaked = [o for o in run.outcomes if o.scenario.startswith("soak")]
    settled = [leaks for leaks in (run.leaks, *(run.leaks.get(when) for when in _SETTLED)) if leaks]
    leaked = sum(leaks["leaked"] for leaks in settled)
    server_errors = sum(count for status, count in statuses.items() if is_server_error(status))
    bad_wrong = sum(1 for row in run.bad_inputs if not row["ok"])
    checks = {
        "every_bad_input_got_its_4xx": len(run.bad_inputs) == len(BAD_REQUESTS) and bad_wrong == 0,
        "overload_got_429_with_retry_after": len(run.overload) == len(OVERLOAD_LIMITS)
        and all(report["rejected_without_retry_after"] == 0 for report in run.overload.values()),
        "no_server_errors_5xx": server_errors == 0,
        "no_crashes": run.health_failures == 0,
        "no_leaks": len(settled) == 1 + len(_SETTLED) and leaked == 0,
        "engine_recovered_from_every_fault": sorted(run.recoveries) == sorted(FAULTS),
        "no_leftover_engine_processes": leftover_processes == 0,
    }
    return {
        "ok": failure is None and all(checks.values()),
        "failure": failure,
        "checks": checks,
        "requests": len(run.outcomes),
        "statuses": {str(status): count for status, count in sorted(statuses.items())},
        "faults_injected": len(run.faults),
        "bad_inputs_tried": len(run.bad_inputs),
        "bad_inputs_wrong_status": bad_wrong,
        "server_errors_5xx": server_errors,
        "engine_errors_returned": sum(statuses[status] for status in ENGINE_ERROR_STATUSES),
        "connection_errors": statuses[0],
        "overloaded_429": statuses[429],
        "max_fault_error_latency_s": max((o.latency_s for o in fault_errors), default=0.0),
        "crashes": run.health_failures,
        "leaked_engine_requests": leaked,
        "soak_requests": len(soaked),
        "soak_disconnects": sum(o.status == CLIENT_LEFT for o in soaked),
        "soak_statuses": {str(k): v for k, v in sorted(Counter(o.status for o in soaked).items())},
        "soak_leaked": run.leaks.get("after_soak", {}).get("leaked"),
        "max_recovery_s": max(run.recoveries.values(), default=None),
        "recovery_s": run.recoveries,
        "admitted_p99_s": {label: r["admitted_p99_s"] for label, r in run.overload.items()},
        "leftover_engine_processes": leftover_processes,
    }


def plot(run: Run, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, (timeline, bars) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [3, 1]})
    colours = {
        200: "tab:green",
        429: "tab:orange",
        502: "tab:red",
        503: "tab:purple",
        504: "tab:brown",
        0: "black",
    }
    for status in sorted({o.status for o in run.outcomes}):
        points = [o for o in run.outcomes if o.status == status]
        label = "client 4xx" if 400 <= status < 429 else f"{status or 'connection error'}"
        timeline.scatter(
            [o.started_s for o in points],
            [o.latency_s for o in points],
            s=10,
            c=colours.get(status, "tab:gray"),
            label=label,
        )
    for fault in run.faults:
        timeline.axvline(fault["at_s"], color="red", linestyle="--")
        timeline.annotate(fault["scenario"], (fault["at_s"], 0), rotation=90, color="red")
        if "recovered_at_s" in fault:
            timeline.axvspan(fault["at_s"], fault["recovered_at_s"], color="red", alpha=0.08)
    timeline.set(xlabel="time since start (s)", ylabel="request latency (s)", title="request outcomes")
    timeline.legend(fontsize=8)
    bars.bar(list(run.recoveries), list(run.recoveries.values()), color="tab:red")
    bars.set(ylabel="seconds", title="recovery: fault → /health 200 + a query")
    save_figure(figure, path)


def print_table(summary: dict[str, Any], run: Run) -> None:
    print(f"\n{'scenario':<28}{'requests':>9}  statuses")
    for scenario in dict.fromkeys(o.scenario for o in run.outcomes):
        rows = [o for o in run.outcomes if o.scenario == scenario]
        statuses = dict(sorted(Counter(o.status for o in rows).items()))
        print(f"{scenario:<28}{len(rows):>9}  {statuses}")
    for name, seconds in run.recoveries.items():
        print(f"recovery after {name}: {seconds:.1f} s")
    for label, report in run.overload.items():
        print(f"overload {label}: {report['statuses']} admitted p99 {report['admitted_p99_s']}")
    print(f"leaks: {run.leaks}")
    print(
        f"{'5xx (not engine errors)':<12}{summary['server_errors_5xx']}   crashes {summary['crashes']}   "
        f"leaked {summary['leaked_engine_requests']}   bad inputs wrong {summary['bad_inputs_wrong_status']}"
    )
    failed = [name for name, held in summary["checks"].items() if not held]
    print(f"checks not held: {', '.join(failed)}" if failed else "every check held")
    if summary["failure"]:
        print(f"the run failed in {summary['failure']}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter loads, fewer disconnects")
    parser.add_argument(
        "--soak-s", type=float, help="seconds of soak with disconnects on the real engine (60 quick, 600)"
    )
    args = parser.parse_args()
    args.clients = 3 if args.quick else 6
    args.burst = 12 if args.quick else 32
    args.disconnects = 12 if args.quick else 60
    if args.soak_s is None:
        args.soak_s = 60.0 if args.quick else 600.0
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    run = Run()
    sys.exit(0 if report(run, run_and_name_failure(args, run), args.quick) else 1)


def run_and_name_failure(args: argparse.Namespace, run: Run) -> dict[str, Any]:
    """Run every scenario; the summary, with the failure that stopped the run (if one did)."""
    stopped: set[int] = set()
    failure = None
    try:
        stop_cleanly_on_sigterm()
        asyncio.run(run_all(args, run, stopped))
    except (Exception, KeyboardInterrupt) as error:  # said in the summary: the run must end saying it
        failure = f"{run.step}: {type(error).__name__}: {error}"
        traceback.print_exc()
    finally:
        leftover = kill_leftover(stopped)  # even on error: nothing may stay stopped or orphaned
    summary = summarize(run, leftover, failure)
    summary["wall_s"] = round(run.now(), 1)
    return summary


def report(run: Run, summary: dict[str, Any], quick: bool) -> bool:
    """Write the JSON and the figure, print the table and, last, the summary line; whether the run
    held. A report that cannot be written is a failure too, but the summary line is printed."""
    try:
        write_json(
            "faults",
            {
                "summary": summary,
                "machine": machine(),
                "quick": quick,
                "first_token_timeout_s": FIRST_TOKEN_TIMEOUT_S,
                "faults": run.faults,
                "overload": run.overload,
                "bad_inputs": run.bad_inputs,
                "leaks": run.leaks,
                "outcomes": [asdict(o) for o in run.outcomes],
            },
        )
        plot(run, plot_path("faults"))
        print_table(summary, run)
    except Exception as error:
        traceback.print_exc()
        summary["failure"] = summary["failure"] or f"writing the report: {type(error).__name__}: {error}"
        summary["ok"] = False
    print(json.dumps(summary, sort_keys=True), flush=True)
    return bool(summary["ok"])


if __name__ == "__main__":
    main()
