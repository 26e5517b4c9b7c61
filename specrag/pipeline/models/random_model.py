"""The generated ``random`` model: a small Llama-architecture model made locally, never downloaded.

Its weights are random (fixed seed), so its answers are noise, but its prefill and decode costs are
those of a real transformer run by the real engine: every latency measured on it is real. It stays
beside the real default model (:mod:`specrag.pipeline.models.catalog`) for experiments that need
to set the prefill cost, such as the pipelining sweep, where search and prefill must cost about the
same.
The tokenizer is a byte-level BPE trained on the bundled corpus, so passages tokenize to a
realistic number of tokens. The size is chosen per machine so that a 4k-token cold prefill on one
CPU core takes about a second, the regime where vector search and prefill cost about the same:
CPUs without native bfloat16 (AVX2-only x86) compute in float32 at a fraction of the speed, and
get a smaller model (see :meth:`RandomModelSpec.for_this_machine`).
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specrag.atomic import atomic_directory
from specrag.errors import ArtifactError, InvalidInputError
from specrag.pipeline.models.directory import MANIFEST_NAME, check_model_dir
from specrag.pipeline.models.dtype import Dtype, cpu_has_native_bf16
from specrag.pipeline.models.weights_digest import record_weights

__all__ = [
    "RANDOM_MODEL_NAME",
    "SPECIAL_TOKENS",
    "ModelSize",
    "RandomModelSpec",
    "is_current_random_model",
    "make_random_model",
    "train_tokenizer",
]

logger = logging.getLogger(__name__)

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)


class ModelSize(enum.StrEnum):
    """The random model's sizes; ``auto`` is the one this machine computes fast
    (:meth:`RandomModelSpec.for_this_machine`)."""

    AUTO = "auto"
    LARGE = "large"
    SMALL = "small"


RANDOM_MODEL_NAME = "random"
"""Its name on the command line, in the data directory and in ``/v1/models``."""


@dataclass(frozen=True)
class RandomModelSpec:
    """Architecture of the random model. Changing any field changes the model (and its fingerprint)."""

    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1536
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    max_position_embeddings: int = 8192
    dtype: str = "bfloat16"
    seed: int = 0

    @classmethod
    def sized(cls, size: str) -> RandomModelSpec:
        """``large``: 8 layers x 512 in bfloat16; ``small``: 3 x 256 in float32."""
        if size == ModelSize.LARGE:
            return cls()
        if size == ModelSize.SMALL:
            return cls(
                hidden_size=256,
                intermediate_size=768,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=4,
                dtype="float32",
            )
        raise InvalidInputError(
            f"model size must be one of {ModelSize.LARGE}, {ModelSize.SMALL}, got {size!r}"
        )

    @classmethod
    def for_this_machine(cls, cpuinfo: str | None = None) -> RandomModelSpec:
        """``large`` where the CPU has native bfloat16, else ``small``.

        Without native bfloat16 the large model prefills an order of magnitude slower, so the
        small one keeps a cold prefill on such a core near the large one's where bfloat16 is
        native (docs/architecture.md, "Measured prefill of the default model";
        ``python -m bench.pipeline.prefill`` measures it). Both share the tokenizer.
        """
        return cls.sized("large" if cpu_has_native_bf16(cpuinfo) else "small")

    def validate(self) -> None:
        if self.vocab_size < 512:
            raise InvalidInputError(f"vocab_size must be at least 512, got {self.vocab_size}")
        if self.hidden_size % self.num_attention_heads:
            raise InvalidInputError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidInputError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.dtype not in (Dtype.BFLOAT16, Dtype.FLOAT32, Dtype.FLOAT16):
            raise InvalidInputError(f"unsupported dtype {self.dtype!r}")


def train_tokenizer(texts: Iterable[str], vocab_size: int, model_max_length: int, output_dir: Path) -> None:
    """Train a byte-level BPE on ``texts`` and save it in the Hugging Face fast-tokenizer format.

    Byte-level means every string is encodable (no unknown token) and decoding is lossless.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(output_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (output_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (output_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, indent=2)
    )


def _write_weights(spec: RandomModelSpec, token_ids: dict[str, int], output_dir: Path) -> None:
    """Random Llama weights from ``spec.seed``, saved as safetensors with a matching config.json."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=token_ids[BOS_TOKEN],
        eos_token_id=token_ids[EOS_TOKEN],
        pad_token_id=token_ids[PAD_TOKEN],
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(output_dir, safe_serialization=True)


def _special_token_id(tokenizer: Any, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ArtifactError(f"the trained tokenizer lacks the special token {token!r}")
    return int(token_id)


def make_random_model(
    output_dir: Path, corpus_texts: Iterable[str], spec: RandomModelSpec | None = None
) -> Path:
    """Write the random model directory (atomically) and return it.

    The directory is a plain Hugging Face model directory: vLLM, transformers or any other loader
    reads it like a downloaded one.
    """
    spec = spec or RandomModelSpec.for_this_machine()
    spec.validate()
    with atomic_directory(output_dir) as staging:
        train_tokenizer(corpus_texts, spec.vocab_size, spec.max_position_embeddings, staging)
        from tokenizers import Tokenizer

        trained = Tokenizer.from_file(str(staging / "tokenizer.json"))
        token_ids = {token: _special_token_id(trained, token) for token in SPECIAL_TOKENS}
        _write_weights(spec, token_ids, staging)
        (staging / MANIFEST_NAME).write_text(
            json.dumps({"name": RANDOM_MODEL_NAME, "spec": asdict(spec)}, indent=2)
        )
        record_weights(staging)  # the document KV key's whole-weights digest, hashed once, here
    logger.info("random model written to %s", output_dir)
    return output_dir


def is_current_random_model(model_dir: Path, spec: RandomModelSpec | None = None) -> bool:
    """True when ``model_dir`` holds a complete random model built from ``spec``."""
    manifest = model_dir / MANIFEST_NAME
    try:
        check_model_dir(model_dir)
        recorded = json.loads(manifest.read_text())["spec"]
    except (ArtifactError, OSError, ValueError, KeyError):
        return False
    return bool(recorded == asdict(spec or RandomModelSpec.for_this_machine()))
