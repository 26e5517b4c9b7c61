"""The modules vLLM's spawned processes import again must not load numba.

vLLM starts its engine core and model worker with ``spawn``, which imports the parent's main
module again in each. A numba (llvmlite) object in ``sys.modules`` there makes the CPU worker fail
at start-up (its Triton kernel rebinding calls ``vars()`` on every module attribute), so every
entry point that starts vLLM must import numba, and ``bm25s`` (which imports numba), only lazily.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

ENTRY_POINTS = (
    "specrag.cli",
    "bench.e2e.__main__",
    "bench.faults",
    "bench.faults.token_gaps",
    "bench.pipeline",
    "bench.scale.__main__",
    "bench.pipeline.prefill",
    "bench.pipeline.contention",
    "bench.pipeline.abort",
)


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_an_entry_point_imports_no_numba(module: str) -> None:
    code = (
        f"import sys, {module}; print(sorted(m for m in ('numba', 'llvmlite', 'bm25s') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
