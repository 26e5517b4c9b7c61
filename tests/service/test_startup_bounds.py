"""Every phase of ``serve``'s start has a bound: a phase that outlives it ends the start with an
error naming the phase, its bound, what it waited for and the flag, the command exits with status
2 within seconds of the bound, and nothing it started is left running; never an endless
``starting``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import psutil
import pytest

from specrag.errors import InvalidInputError
from specrag.locking import writer_lock
from specrag.paths import DataLayout
from specrag.service.run.assets import Assets
from specrag.service.run.lifecycle import RunningService, serve_until_signalled
from specrag.service.run.startup import (
    DEFAULT_BOUNDS_S,
    Phase,
    StartupProgress,
    StartupTimeoutError,
    bind_listener,
    parse_bounds,
)
from tests.helpers.http import free_port

REPOSITORY = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")])}
# A CLI start on a loaded 2-core machine: the interpreter, transformers for the tokenizer.
COMMAND_TIMEOUT_S = 300


def test_bounds_are_given_per_phase_over_the_defaults() -> None:
    bounds = parse_bounds(["engine_load=30", "artefacts=2.5"])
    assert bounds == {**DEFAULT_BOUNDS_S, Phase.ENGINE_LOAD: 30.0, Phase.ARTEFACTS: 2.5}
    assert set(DEFAULT_BOUNDS_S) == set(Phase) - {Phase.READY}  # every phase has one


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("engine_load", "give PHASE=SECONDS"),
        ("warmup=10", "PHASE one of imports, artefacts, engine_load"),
        ("started=10", "PHASE one of"),
        ("engine_load=0", "positive number of seconds"),
        ("engine_load=-5", "positive number of seconds"),
        ("engine_load=nan", "positive number of seconds"),
        ("engine_load=inf", "positive number of seconds"),
        ("engine_load=soon", "positive number of seconds"),
    ],
)
def test_a_bad_bound_is_refused_naming_the_flag(given: str, says: str) -> None:
    with pytest.raises(InvalidInputError, match=f"--startup-timeout '{given}': .*{says}"):
        parse_bounds([given])


def test_a_phase_past_its_bound_says_what_it_waited_for() -> None:
    progress = StartupProgress(bounds_s={**DEFAULT_BOUNDS_S, Phase.ENGINE_LOAD: 0.01})
    progress.begin(Phase.ARTEFACTS)
    progress.begin(Phase.ENGINE_LOAD, "vLLM to start on /models/tiny")
    assert progress.phase is Phase.ENGINE_LOAD  # the one that began last, the artefacts still checked
    time.sleep(0.05)
    said = progress.overdue()
    assert said is not None
    assert "start-up phase engine_load did not end within its bound of 0.01 s" in said
    assert "vLLM to start on /models/tiny" in said and "--startup-timeout engine_load=SECONDS" in said
    progress.end(Phase.ENGINE_LOAD)
    assert progress.overdue() is None and progress.phase is Phase.ARTEFACTS


class NeverStarts:
    """A start (what serve_until_signalled enters) that runs ``waiting`` and yields no service."""

    def __init__(self, waiting: Callable[[], Awaitable[None]]) -> None:
        self._waiting = waiting

    async def __aenter__(self) -> RunningService:
        await self._waiting()
        raise AssertionError("a start that never ends ended")

    async def __aexit__(self, *exception: object) -> None:
        return None


async def test_a_start_that_never_ends_is_abandoned_at_its_bound_and_unwinds_in_order() -> None:
    listener = bind_listener("127.0.0.1", 0)
    base = f"http://127.0.0.1:{listener.getsockname()[1]}"
    progress = StartupProgress(bounds_s={**DEFAULT_BOUNDS_S, Phase.ENGINE_LOAD: 1.0})
    unwound = asyncio.Event()

    async def engine_that_never_answers() -> None:
        progress.begin(Phase.ENGINE_LOAD, "an engine that never answers")
        try:
            await asyncio.Event().wait()  # never set
        finally:
            unwound.set()

    start = functools.partial(NeverStarts, engine_that_never_answers)

    said = asyncio.Queue[str]()
    started = time.monotonic()
    with contextlib.closing(listener):
        serving = asyncio.create_task(
            serve_until_signalled(listener, progress, start, shutdown_timeout_s=1.0, announce=said.put_nowait)
        )
        async with aiohttp.ClientSession() as session:
            assert (await said.get()).startswith("specrag listening on")
            async with session.get(f"{base}/health") as response:
                assert response.status == 503
                assert (await response.json())["reason"] == "starting: engine_load"
        with pytest.raises(
            StartupTimeoutError, match="engine_load did not end within its bound of 1 s"
        ) as error:
            await asyncio.wait_for(serving, 30)
    assert "an engine that never answers" in str(error.value)
    assert time.monotonic() - started >= 1.0
    assert unwound.is_set()


async def test_an_unwind_that_waits_for_ever_is_cut_short() -> None:
    """Like vLLM's start, which the service lets finish before it closes the engine."""
    listener = bind_listener("127.0.0.1", 0)
    progress = StartupProgress(bounds_s={**DEFAULT_BOUNDS_S, Phase.ARTEFACTS: 0.5})

    async def artefacts_that_never_unwind() -> None:
        progress.begin(Phase.ARTEFACTS)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.Event().wait()  # the unwind never ends by itself

    start = functools.partial(NeverStarts, artefacts_that_never_unwind)

    with contextlib.closing(listener):
        serving = serve_until_signalled(
            listener, progress, start, shutdown_timeout_s=1.0, announce=lambda _: None, unwind_grace_s=0.5
        )
        with pytest.raises(StartupTimeoutError, match="start-up phase artefacts did not end"):
            await asyncio.wait_for(serving, 30)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _serve(
    data_dir: Path, *arguments: str, helper: list[str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    command = [sys.executable, "-m", *(helper or ["specrag"]), "--data-dir", str(data_dir), "serve"]
    started = time.monotonic()
    result = subprocess.run(
        [*command, "--port", str(free_port()), *arguments],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    return result, time.monotonic() - started


def test_serve_whose_engine_never_starts_exits_at_the_bound_with_nothing_left_running(
    tiny_assets: Assets, tmp_path: Path
) -> None:
    """The engine's start blocks a thread for ever and started a child process, as a hung vLLM
    start does: the command says so and exits with status 2, its child stopped."""
    pid_file = tmp_path / "engine.pid"
    data_dir = tiny_assets.store.path.parent.parent
    result, took_s = _serve(
        data_dir,
        "--model",
        str(tiny_assets.model_dir),
        "--startup-timeout",
        "engine_load=3",
        helper=["tests.helpers.hanging_start", str(pid_file)],
    )
    assert result.returncode == 2, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(
        "specrag serve: error: start-up phase engine_load did not end within its bound of 3 s"
    )
    assert f"vLLM to start on {tiny_assets.model_dir}" in error and "--startup-timeout engine_load=" in error
    assert took_s >= 3
    assert _gone(int(pid_file.read_text()))  # the engine's child process was stopped


def test_serve_waiting_for_an_artefact_another_process_writes_exits_at_the_bound(
    tiny_assets: Assets, tmp_path: Path
) -> None:
    """A writer that never finishes (here: this test, holding the corpus's lock) held serve in
    ``starting: artefacts`` for ever; with --engine-url no engine starts."""
    data_dir = tiny_assets.store.path.parent.parent
    with writer_lock(DataLayout(data_dir).corpus_file):
        result, took_s = _serve(
            data_dir,
            "--model",
            str(tiny_assets.model_dir),
            "--engine-url",
            f"http://127.0.0.1:{free_port()}",
            "--startup-timeout",
            "artefacts=2",
        )
    assert result.returncode == 2, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(
        "specrag serve: error: start-up phase artefacts did not end within its bound of 2 s"
    )
    assert "another process writing an artefact" in error
    assert took_s >= 2
