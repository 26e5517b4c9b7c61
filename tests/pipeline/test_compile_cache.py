"""A compiled engine's second start reuses what the first compiled (slow: two compiled starts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

# The script runs this checkout's specrag, wherever the installed one points.
REPOSITORY = Path(__file__).resolve().parents[2]
# vLLM's line when its compile cache could not be loaded and the model is compiled from scratch.
COMPILED_AGAIN = "Compiling model again"

START_AND_STOP = """
import asyncio

from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.engines.vllm_engine import VllmEngine


async def main() -> None:
    engine = await VllmEngine.start(EngineConfig(model={model!r}, max_model_len=2048, enforce_eager=False))
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
"""


def test_a_second_compiled_start_loads_the_compile_cache_instead_of_compiling_again(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "start_and_stop.py"
    script.write_text(START_AND_STOP.format(model=str(tiny_model_dir)), encoding="utf-8")
    env = {
        **{name: value for name, value in os.environ.items() if name != "VLLM_USE_AOT_COMPILE"},
        "PYTHONPATH": os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")]),
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),  # empty before the first start
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache"),
    }
    outputs = []
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900, check=False
        )
        assert run.returncode == 0, run.stderr[-3000:]
        outputs.append(run.stdout + run.stderr)
    assert COMPILED_AGAIN not in outputs[1], outputs[1][-3000:]
