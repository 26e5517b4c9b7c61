"""The compute dtype a model runs in on this machine: a CPU without native bfloat16 gets float32.

A model's own dtype (bfloat16 for most models on the hub) is what vLLM's ``auto`` picks, and a
CPU that only emulates bfloat16 runs it many times slower than float32 (docs/vllm-cpu.md); the
generated random model is sized by the same test. It lives with the model files, not the engine
settings, because both the model maker and the engine ask it.
"""

from __future__ import annotations

import enum
from pathlib import Path

__all__ = ["Dtype", "cpu_has_native_bf16", "engine_dtypes", "note_engine_dtype", "resolve_dtype"]


class Dtype(enum.StrEnum):
    """The compute dtypes vLLM may be started with (``auto``: the model's own, see :func:`resolve_dtype`)."""

    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


# The dtypes the engines started in this process compute in, as vLLM resolved them: what a
# benchmark's JSON records next to its figures (bench/common.py, machine()).
_ENGINE_DTYPES: set[str] = set()


# CPU flags (x86 /proc/cpuinfo "flags", aarch64 "Features") that mean bfloat16 matrix products run
# natively. Without them PyTorch emulates bfloat16, many times slower than float32 (docs/vllm-cpu.md).
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes in bfloat16 natively (``cpuinfo``: the text of /proc/cpuinfo)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True  # not Linux: leave the choice to vLLM
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features") and _NATIVE_BF16_FLAGS & set(value.split()):
            return True
    return False


def resolve_dtype(dtype: str, on_cpu: bool, cpuinfo: str | None = None) -> str:
    """The dtype to start vLLM with: ``auto`` becomes float32 on a CPU without native bfloat16.

    vLLM's ``auto`` takes the model's own dtype (bfloat16 for the default model and most models
    on the hub), which such a CPU can only emulate. An explicit dtype is always kept.
    """
    if dtype == Dtype.AUTO and on_cpu and not cpu_has_native_bf16(cpuinfo):
        return Dtype.FLOAT32
    return dtype


def note_engine_dtype(dtype: object) -> None:
    """Record that an engine of this process computes in ``dtype`` (a ``torch.dtype`` or its name).

    The dtype decides vLLM's CPU speed (~10x between bfloat16 emulated and float32), so figures
    measured without it cannot be compared; the engine notes the one vLLM settled on.
    """
    _ENGINE_DTYPES.add(str(dtype).removeprefix("torch."))


def engine_dtypes() -> list[str]:
    """The dtypes noted by :func:`note_engine_dtype` in this process, sorted (empty: no engine ran)."""
    return sorted(_ENGINE_DTYPES)
