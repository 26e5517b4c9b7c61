"""The locally made default model: a loadable Hugging Face directory with a corpus-trained tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from specrag.errors import ArtifactError, InvalidInputError
from specrag.pipeline.models.random_model import (
    RandomModelSpec,
    check_model_dir,
    is_current_random_model,
    make_random_model,
)
from specrag.pipeline.models.tokenizer import Tokenizer, tokenizer_fingerprint
from tests.helpers.models import TINY_MODEL_SPEC


def test_model_dir_is_a_llama_checkpoint_matching_its_spec(tiny_model_dir: Path) -> None:
    check_model_dir(tiny_model_dir)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == TINY_MODEL_SPEC.num_hidden_layers
    assert config["vocab_size"] == TINY_MODEL_SPEC.vocab_size
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as weights:
        embedding = weights.get_tensor("model.embed_tokens.weight")
    assert tuple(embedding.shape) == (TINY_MODEL_SPEC.vocab_size, TINY_MODEL_SPEC.hidden_size)
    assert is_current_random_model(tiny_model_dir, TINY_MODEL_SPEC)
    assert not is_current_random_model(tiny_model_dir, RandomModelSpec())


def test_tokenizer_round_trips_corpus_text_without_special_tokens(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer(tiny_model_dir)
    text = "The assert statement raises AssertionError — even with ünïcode."
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert max(ids) < TINY_MODEL_SPEC.vocab_size
    assert tokenizer.encode_batch([text, "x"]) == [ids, tokenizer.encode("x")]
    # Trained on the corpus: common words are single tokens, so text compresses well below bytes.
    assert len(ids) < len(text.encode()) / 2
    assert tokenizer.fingerprint == tokenizer_fingerprint(tiny_model_dir)


def test_same_seed_same_weights(tmp_path: Path, tiny_model_dir: Path) -> None:
    texts = ["alpha beta gamma delta " * 50, "epsilon zeta eta theta " * 50]
    spec = RandomModelSpec(
        vocab_size=600,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    first = make_random_model(tmp_path / "a", texts, spec)
    second = make_random_model(tmp_path / "b", texts, spec)
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(second)


def test_incomplete_model_dir_names_the_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not found"):
        check_model_dir(tmp_path / "absent")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ArtifactError, match=r"lacks model\.safetensors"):
        check_model_dir(tmp_path)
    assert not is_current_random_model(tmp_path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"vocab_size": 10}, "vocab_size"),
        ({"hidden_size": 100, "num_attention_heads": 3}, "multiple of num_attention_heads"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"dtype": "int4"}, "unsupported dtype"),
    ],
)
def test_invalid_specs_are_rejected(tmp_path: Path, changes: dict[str, object], message: str) -> None:
    spec = RandomModelSpec(**changes)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match=message):
        make_random_model(tmp_path / "m", ["text"], spec)
    assert not (tmp_path / "m").exists()


def test_the_default_size_follows_the_cpu_and_both_sizes_are_valid() -> None:
    native = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16\n"
    avx2_only = "flags\t\t: avx avx2 fma\n"
    assert RandomModelSpec.for_this_machine(native) == RandomModelSpec.sized("large") == RandomModelSpec()
    small = RandomModelSpec.for_this_machine(avx2_only)
    assert small == RandomModelSpec.sized("small") and small.dtype == "float32"
    large = RandomModelSpec()
    assert small.num_hidden_layers * small.hidden_size < large.num_hidden_layers * large.hidden_size
    for spec in (RandomModelSpec.sized("large"), small):
        spec.validate()
    with pytest.raises(InvalidInputError, match="large, small"):
        RandomModelSpec.sized("huge")
