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
PARENT = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_every_descendant_process_is_pinned_to_the_engine_cores() -> None:
    core = min(os.sched_getaffinity(0))
    parent = subprocess.Popen([sys.executable, "-c", PARENT])
    root = psutil.Process(parent.pid)
    try:
        deadline = time.monotonic() + 30
        while not root.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pin_engine_processes({core}, root)) == 1  # the grandchild, not the root itself
        (grandchild,) = root.children()
        assert os.sched_getaffinity(grandchild.pid) == {core}
    finally:
        for process in [*root.children(recursive=True), root]:
            process.kill()
        parent.wait()
