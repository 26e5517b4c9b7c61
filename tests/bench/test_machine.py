"""Every benchmark's JSON names the machine it was measured on, and the dtype its engine used."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import bench.common as common
from specrag.pipeline.models import dtype

# /proc/cpuinfo of a CPU with AVX2 but no native bfloat16 (the issue 49 machine).
AVX2_ONLY = "model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n"


@pytest.fixture
def out_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(common, "OUT_DIR", tmp_path)
    monkeypatch.setattr(dtype, "_ENGINE_DTYPES", set())
    return tmp_path


def test_the_written_json_names_the_machine_and_the_engines_dtype(out_dir: Path) -> None:
    dtype.note_engine_dtype("torch.float32")  # as VllmEngine notes vLLM's model_config.dtype
    path = common.write_json("anything", {"figures": [1, 2]})

    written = json.loads(path.read_text())
    assert written["figures"] == [1, 2]
    machine = written["machine"]
    assert machine["cpu_model"] == common.cpu_model()
    assert machine["cpus"] >= 1
    assert isinstance(machine["native_bf16"], bool)
    assert machine["engine_dtypes"] == ["float32"]
    assert machine["dtype_auto"] in {"auto", "float32"}
    assert "debian" in machine


def test_a_cpu_without_native_bf16_is_said_and_auto_means_float32(
    out_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    detect = dtype.cpu_has_native_bf16

    def without(cpuinfo: str | None = None) -> bool:
        return detect(AVX2_ONLY)

    monkeypatch.setattr(dtype, "cpu_has_native_bf16", without)
    monkeypatch.setattr(common, "cpu_has_native_bf16", without)

    machine = json.loads(common.write_json("x", {}).read_text())["machine"]
    assert machine["native_bf16"] is False
    assert machine["dtype_auto"] == "float32"
    assert machine["engine_dtypes"] == []  # no engine ran in this process


def test_a_benchmarks_own_machine_record_is_replaced_by_the_one_taken_at_writing(out_dir: Path) -> None:
    """A benchmark that recorded machine() before its engine started would miss the dtype."""
    early = common.machine()
    dtype.note_engine_dtype("bfloat16")
    written = json.loads(common.write_json("x", {"machine": early}).read_text())
    assert early["engine_dtypes"] == []
    assert written["machine"]["engine_dtypes"] == ["bfloat16"]


REPOSITORY = Path(__file__).resolve().parents[2]


def _main_source(module: str, seen: set[str] | None = None) -> str:
    """The source ``python -m MODULE`` runs: its file, or its package's __main__, and the modules of
    its own family that imports (``bench.e2e`` measures in :mod:`bench.e2e.measure`), and the module
    whose ``main`` it imports (``bench.scale`` runs :mod:`bench.scale.routers`)."""
    seen = set() if seen is None else seen
    seen.add(module)
    base = REPOSITORY / module.replace(".", "/")
    path = base / "__main__.py" if base.is_dir() else base.with_suffix(".py")
    source = path.read_text(encoding="utf-8")
    family = ".".join(module.split(".")[:2])
    imported = re.findall(r"^from (bench[\w.]*) import ", source, re.MULTILINE)
    follow = [
        name
        for name in imported
        if name not in seen
        and (
            name.startswith(family + ".") or re.search(rf"^from {re.escape(name)} import main$", source, re.M)
        )
    ]
    return source + "".join(_main_source(name, seen) for name in follow)


def test_every_benchmark_the_readme_names_writes_its_json_through_write_json() -> None:
    """write_json is what names the machine and the dtype: a benchmark writing its JSON by
    itself would publish figures without them."""
    named = set(re.findall(r"python -m (bench(?:\.\w+)*)", (REPOSITORY / "README.md").read_text()))
    assert len(named) >= 10, named
    for module in sorted(named):
        source = _main_source(module)
        assert "write_json(" in source or "write_report(" in source, module
        assert "json.dump(" not in source, module
