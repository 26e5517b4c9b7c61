"""The benchmarks' shared helpers."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from bench.common import pin_engine_processes

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
