"""scripts/emulate-avx2-only.sh: a command run under it sees a CPU without AVX-512 everywhere the
engine and specrag look (so figures measured under it are an AVX2-only machine's code paths), and
the machine outside it is unchanged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "emulate-avx2-only.sh"
PROBE = """
import json, torch, torch.cpu
from specrag.pipeline.models.dtype import cpu_has_native_bf16
from vllm.platforms import current_platform
current_platform.import_kernels()
print(json.dumps({
    "avx512": torch.cpu._is_avx512_supported(),
    "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
    "amx": torch.cpu._is_amx_tile_supported(),
    "capability": torch.backends.cpu.get_cpu_capability(),
    "native_bf16": cpu_has_native_bf16(),
    "cpuinfo_avx512": "avx512" in open("/proc/cpuinfo").read(),
    "kernels": sorted({line.split()[-1].rsplit("/", 1)[-1] for line in open("/proc/self/maps")
                       if "/vllm/_C" in line}),
}))
"""

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="the mount namespace needs root"
)


def probe(*prefix: str) -> dict[str, object]:
    done = subprocess.run(
        [*prefix, sys.executable, "-c", PROBE],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_command_sees_no_avx512_and_vllm_loads_its_avx2_kernels() -> None:
    seen = probe(str(SCRIPT))
    assert seen == {
        "avx512": False,
        "avx512_bf16": False,
        "amx": False,
        "capability": "AVX2",
        "native_bf16": False,
        "cpuinfo_avx512": False,
        "kernels": ["_C_AVX2.abi3.so"],
    }


def test_the_machine_outside_is_unchanged() -> None:
    outside = probe()
    if not outside["avx512"]:
        pytest.skip("this CPU has no AVX-512: nothing to hide")
    probe(str(SCRIPT))
    assert probe() == outside
    assert "avx512" in Path("/proc/cpuinfo").read_text()


def test_without_a_command_it_says_how_to_use_it() -> None:
    done = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "usage" in done.stderr
