"""Makes torch answer "no" to every AVX-512 and AMX question, in this process and every Python
process it starts (vLLM's engine core and model worker are spawned with this environment).

vLLM's CPU platform asks ``torch.cpu._is_avx512_supported()`` and its siblings to choose its
kernel library (``_C`` / ``_C_AVX512`` / ``_C_AVX2``) and its attention paths; torch answers from
the CPUID instruction, which no environment variable changes. Patching ``torch.cpu`` as it is
imported (not importing torch here) keeps every other process's start-up time what it was.
Used by ``scripts/emulate-avx2-only.sh``, which explains the rest.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

_ANSWER_NO = (
    "_is_avx512_supported",
    "_is_avx512_vnni_supported",
    "_is_avx512_bf16_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
)


def _no() -> bool:
    return False


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        for name in _ANSWER_NO:
            if hasattr(module, name):
                setattr(module, name, _no)


class _TorchCpuFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


sys.meta_path.insert(0, _TorchCpuFinder())
