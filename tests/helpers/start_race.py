"""One fresh interpreter racing the imports of ``serve``'s start, for tests/service/test_start_imports.py.

``python -m tests.helpers.start_race DATA_DIR MODEL_DIR {serve,none}`` imports what the command
line imports, then (``serve``) the start-up imports as ``serve`` makes them, on this thread; then
three threads run at once what a start runs side by side: the artefact checks
(:func:`ensure_assets`, and MiniLM's encoder as loading the default index builds it), the event
loop's part of the engine's start (:func:`~specrag.service.run.pools.starter`) and the part vLLM's
start runs on its own thread before it spawns its processes (vLLM's engine, its arguments). With
``none`` nothing is imported first, as before the ``imports`` phase. Prints one JSON line: the
threads' errors, and the packages beyond the standard library that more than one thread imported
modules of (each import recorded by a finder first on ``sys.meta_path``, which Python asks only
for modules not imported yet).
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from specrag.cli import build_parser
from specrag.paths import DataLayout
from specrag.service.run.assets import ensure_assets
from specrag.service.run.imports import import_for_start, start_imports


class ImportRecorder:
    """A finder that finds nothing and notes which thread asked for which module."""

    def __init__(self) -> None:
        self.imported: list[tuple[str, str]] = []

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        self.imported.append((threading.current_thread().name, name))
        return None


def shared_packages(imported: list[tuple[str, str]]) -> dict[str, list[str]]:
    """Packages outside the standard library with modules imported by more than one thread."""
    threads: dict[str, set[str]] = {}
    for thread, name in imported:
        threads.setdefault(name.split(".")[0], set()).add(thread)
    return {
        package: sorted(names)
        for package, names in sorted(threads.items())
        if len(names) > 1 and package not in sys.stdlib_module_names
    }


def race(data_dir: Path, model_dir: Path) -> tuple[list[str], dict[str, list[str]]]:
    """Run the three sides at once; their errors, and the packages more than one imported."""
    from specrag.pipeline.engines.config import EngineConfig

    config = EngineConfig(model=str(model_dir), enforce_eager=True)
    errors: list[str] = []
    barrier = threading.Barrier(3)

    def artefacts() -> None:
        ensure_assets(DataLayout(data_dir), model=model_dir)
        from specrag.retrieval.embedders.minilm_embedder import minilm_weights

        minilm_weights()

    def event_loop() -> None:
        from specrag.service.run.pools import starter

        starter(config)

    def vllm_start() -> None:
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401  (what VllmEngine.start imports)

        from specrag.pipeline.engines.vllm_engine import _engine_args

        _engine_args(config)

    def run(side: Callable[[], None]) -> None:
        barrier.wait()
        try:
            side()
        except BaseException as error:
            errors.append("".join(traceback.format_exception_only(error)).strip())

    recorder = ImportRecorder()
    sys.meta_path.insert(0, recorder)
    threads = [
        threading.Thread(target=run, args=(side,), name=side.__name__)
        for side in (artefacts, event_loop, vllm_start)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sys.meta_path.remove(recorder)
    return errors, shared_packages(recorder.imported)


def main(argv: Sequence[str]) -> None:
    data_dir, model_dir, mode = Path(argv[0]), Path(argv[1]), argv[2]
    build_parser()  # what `specrag serve` has imported when its start begins
    if mode == "serve":
        import_for_start(start_imports(in_process_engine=True, embedder=None))  # MiniLM and WordLlama
    errors, shared = race(data_dir, model_dir)
    print(json.dumps({"errors": errors, "shared": shared}))


if __name__ == "__main__":
    main(sys.argv[1:])
