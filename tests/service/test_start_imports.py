"""``serve``'s start imports each large package once, on one thread, before its threads run side by
side: the artefact checks, the event loop's part of the engine's start and vLLM's own thread then
import no package in common, so none of them can be handed another's half-run module (the
``ImportError: cannot import name 'dispatch_model' from partially initialized module
'accelerate.big_modeling'`` that crashed one start in about fifteen).

Each race runs in a fresh interpreter (tests/helpers/start_race.py), three threads released at
once. The same race without the ``imports`` phase, as the start ran before, is the control: its
threads do import the same packages (torch and transformers at least), so the check can fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from specrag.retrieval.index_store import MINILM, WORDLLAMA
from specrag.service.run.assets import Assets
from specrag.service.run.imports import start_imports

REPOSITORY = Path(__file__).resolve().parents[2]
# Fresh interpreters importing torch, transformers and vLLM: about 15 s of CPU each.
RACE_TIMEOUT_S = 300
RACES_WITH_THE_IMPORTS_PHASE = 2


def _copy_of(data_dir: Path, to: Path) -> Path:
    """A data directory of its own: each process writes its live corpus's log alone."""
    return Path(shutil.copytree(data_dir, to, ignore=shutil.ignore_patterns("run", ".*.lock")))


def _race(data_dir: Path, model_dir: Path, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "tests.helpers.start_race", str(data_dir), str(model_dir), mode]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _outcome(process: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        output, errors = process.communicate(timeout=RACE_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, errors[-3000:]
    result: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
    return result


def test_the_threads_of_a_start_import_no_package_in_common_and_never_fail_to_import(
    tiny_assets: Assets, tmp_path: Path
) -> None:
    data_dir = tiny_assets.store.path.parent.parent
    modes = ["serve"] * RACES_WITH_THE_IMPORTS_PHASE + ["none"]
    races = [
        _race(_copy_of(data_dir, tmp_path / f"data-{number}"), tiny_assets.model_dir, mode)
        for number, mode in enumerate(modes)
    ]
    outcomes = [_outcome(process) for process in races]
    *started, control = outcomes
    for outcome in started:
        assert outcome == {"errors": [], "shared": {}}, outcome
    # Without the imports phase the same threads import torch and transformers side by side.
    assert {"torch", "transformers"} <= set(control["shared"]), control


def test_the_imports_follow_the_engine_and_the_embedder() -> None:
    def names(in_process_engine: bool, embedder: str | None) -> set[str]:
        return {
            load.__qualname__
            for load in start_imports(in_process_engine=in_process_engine, embedder=embedder)
        }

    assert "import vllm.v1.engine.async_llm" in names(True, MINILM)
    assert not any("vllm" in name for name in names(False, MINILM))  # --engine-url, Ray: vLLM is elsewhere
    assert names(False, WORDLLAMA) != names(False, MINILM)
    assert names(False, None) == names(False, MINILM) | names(False, WORDLLAMA)
