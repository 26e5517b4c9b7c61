"""``specrag serve`` whose engine never starts, for tests/service/test_startup_bounds.py.

``python -m tests.helpers.hanging_start PID_FILE SERVE_ARGS...`` runs the real command with the
in-process engine's start replaced by one that starts a child process (as vLLM starts its own),
writes its pid to PID_FILE, and then blocks a thread for ever (as vLLM's start blocks one that
nothing can cancel). The start-up imports are skipped: this engine needs none, and the test
stays short.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

from specrag import cli
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.engines.protocol import Engine
from specrag.service.cli import commands
from specrag.service.run import assembly


def hanging_starter(pid_file: Path) -> Callable[..., Callable[[], Awaitable[Engine]]]:
    def starter(
        config: EngineConfig, pin_to: frozenset[int] | None = None
    ) -> Callable[[], Awaitable[Engine]]:
        def spawn_and_block() -> None:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            pid_file.write_text(str(child.pid))
            threading.Event().wait()  # never set

        async def start() -> Engine:
            await asyncio.to_thread(spawn_and_block)
            raise AssertionError("unreachable")

        return start

    return starter


def main(argv: list[str]) -> int:
    assembly.starter = hanging_starter(Path(argv[0]))
    commands.start_imports = lambda **_: ()
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
