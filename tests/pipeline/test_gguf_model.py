"""GGUF → Hugging Face conversion (the default model's set-up), on a tiny GGUF made by the test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from specrag.errors import ArtifactError
from specrag.paths import DataLayout
from specrag.pipeline.models import catalog as model_catalog
from specrag.pipeline.models.directory import MANIFEST_NAME, check_model_dir, served_model_name
from specrag.pipeline.models.gguf import convert_gguf, is_converted_from
from specrag.pipeline.models.tokenizer import Tokenizer

SOURCE = {"wheel": "test", "version": "0"}


def test_conversion_gives_back_the_weights_and_the_tokenizer(
    tiny_model_dir: Path, tiny_chat_model_dir: Path
) -> None:
    check_model_dir(tiny_chat_model_dir)
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    converted = load_file(str(tiny_chat_model_dir / "model.safetensors"))
    assert set(converted) == set(original)
    for name, tensor in original.items():  # the tiny model is bfloat16 already: nothing to round
        assert converted[name].dtype == tensor.dtype
        assert bool((converted[name] == tensor).all()), name
    text = "The assert statement raises AssertionError — even with ünïcode."
    assert Tokenizer(tiny_chat_model_dir).encode(text) == Tokenizer(tiny_model_dir).encode(text)
    config = json.loads((tiny_chat_model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]


def test_manifest_names_the_model_and_its_source(tiny_chat_model_dir: Path, tiny_gguf_file: Path) -> None:
    manifest = json.loads((tiny_chat_model_dir / MANIFEST_NAME).read_text())
    assert manifest["name"] == served_model_name(tiny_chat_model_dir) == "tiny-chat"
    assert manifest["source"]["wheel"] == "test" and manifest["source"]["gguf_file"] == "tiny.gguf"
    assert set(manifest["files"]) >= {"model.safetensors", "tokenizer.json", "config.json"}
    assert is_converted_from(tiny_chat_model_dir, tiny_gguf_file, SOURCE)
    assert not is_converted_from(tiny_chat_model_dir, tiny_gguf_file, {**SOURCE, "version": "1"})


def test_a_damaged_conversion_is_not_taken_for_a_good_one(
    tiny_chat_model_dir: Path, tiny_gguf_file: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_chat_model_dir, copy)
    assert is_converted_from(copy, tiny_gguf_file, SOURCE)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)  # same size, other bytes
    assert not is_converted_from(copy, tiny_gguf_file, SOURCE)
    (copy / "tokenizer.json").unlink()
    assert not is_converted_from(copy, tiny_gguf_file, SOURCE)


def test_a_failed_conversion_leaves_no_directory(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF but not really")
    with pytest.raises(ArtifactError, match="cannot read the GGUF model"):
        convert_gguf(broken, tmp_path / "out", name="x", source=SOURCE)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ArtifactError, match="not found"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out", name="x", source=SOURCE)


def test_the_default_model_is_converted_once_from_the_wheel(
    tiny_gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The catalogue converts the wheel's file into the data directory, then reuses it."""
    monkeypatch.setattr(model_catalog, "smollm2_gguf", lambda: (tiny_gguf_file, "9.9"))
    conversions: list[Path] = []
    real_convert = model_catalog.convert_gguf

    def counting(gguf_file: Path, output: Path, **kwargs: object) -> Path:
        conversions.append(output)
        return real_convert(gguf_file, output, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(model_catalog, "convert_gguf", counting)
    layout = DataLayout(tmp_path)
    first = model_catalog.resolve_model(layout, None, [])
    second = model_catalog.resolve_model(layout, model_catalog.DEFAULT_MODEL_NAME, [])
    assert first == second == layout.named_model_dir(model_catalog.DEFAULT_MODEL_NAME)
    assert conversions == [first]
    assert served_model_name(first) == model_catalog.SERVED_NAME
    manifest = json.loads((first / MANIFEST_NAME).read_text())
    assert manifest["source"]["wheel"] == model_catalog.SMOLLM2_WHEEL
    assert manifest["source"]["version"] == "9.9"


def test_model_names_and_directories(tiny_model_dir: Path, tmp_path: Path) -> None:
    layout = DataLayout(tmp_path)
    assert model_catalog.resolve_model(layout, str(tiny_model_dir), []) == tiny_model_dir
    with pytest.raises(ArtifactError, match="neither a model name"):
        model_catalog.resolve_model(layout, "gpt-17", [])
    with pytest.raises(ArtifactError, match="model directory not found"):
        model_catalog.resolve_model(layout, str(tmp_path / "nowhere"), [])
