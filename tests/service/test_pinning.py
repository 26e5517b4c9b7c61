"""Pinning the engine and the search apart: every thread of every process the engine started,
and the service's own process, also after the supervisor replaced a dead engine."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from specrag.controller.controller import RagRequest
from specrag.service.run.assembly import ServiceOptions, open_service
from specrag.service.run.assets import Assets
from specrag.service.run.pinning import descendant_pids, pin_engine_processes
from tests.helpers.builders import QUESTION

# A process that starts a process of its own, as vLLM's engine core starts its model worker.
# The grandchild runs a second thread, as vLLM's processes run I/O threads beside their main one.
CHILD = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"
PARENT = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {CHILD!r}]); time.sleep(60)"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_every_thread_of_every_descendant_is_pinned_to_the_engine_cores() -> None:
    core = min(os.sched_getaffinity(0))
    parent = subprocess.Popen([sys.executable, "-c", PARENT])
    root = psutil.Process(parent.pid)
    try:
        deadline = time.monotonic() + 30
        while not (root.children() and root.children()[0].num_threads() == 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pin_engine_processes({core}, root)) == 1  # the grandchild, not the root itself
        (grandchild,) = root.children()
        assert [os.sched_getaffinity(thread.id) for thread in grandchild.threads()] == [{core}, {core}]
    finally:
        for process in [*root.children(recursive=True), root]:
            process.kill()
        parent.wait()


def affinities(process: psutil.Process) -> set[frozenset[int]]:
    """The distinct core sets of ``process``'s threads."""
    return {frozenset(os.sched_getaffinity(thread.id)) for thread in process.threads()}


def started_since(before: set[int]) -> list[psutil.Process]:
    """The processes this one started since ``before`` was taken (another engine's stay out)."""
    return [psutil.Process(pid) for pid in descendant_pids() - before]


@pytest.mark.engine
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin apart")
async def test_the_service_pins_the_engine_and_itself_apart_and_again_after_a_restart(
    tiny_assets: Assets, tmp_path: Path
) -> None:
    ours, others = affinities(psutil.Process()), descendant_pids()
    request = RagRequest(QUESTION, k=3, mode="all", max_tokens=2)
    options = ServiceOptions(engine_cpus="0", search_cpus="1", eager=True)
    async with open_service(tiny_assets, options, tmp_path / "run") as service:
        engine = started_since(others)
        assert engine and set().union(*map(affinities, engine)) == {frozenset({0})}
        assert (await service.controller.answer(request)).timeline.ttft_s is not None
        # Every thread here, the search thread the first search started included, is on core 1.
        assert affinities(psutil.Process()) == {frozenset({1})}

        for process in engine:
            process.kill()  # the engine dies; the supervisor starts the next from this pinned process
        service.supervised_engine().report_failure("killed by the test")
        assert (
            await service.supervised_engine().wait_ready(300) and service.supervised_engine().state == "ready"
        )
        replaced = started_since(others)
        assert replaced and set().union(*map(affinities, replaced)) == {frozenset({0})}
        assert (await service.controller.answer(request)).timeline.ttft_s is not None
    assert affinities(psutil.Process()) == ours  # the service gives this process its cores back
