"""Build, save and load a :class:`VectorIndex` as one checked directory.

The directory holds the faiss index, the embedder (no pickles), the passage ids in row order,
the synthetic-row mapping of a padded index, the lexical (BM25) index of a hybrid one in
``lexical/``, and ``manifest.json`` with the dimensions, metric, kind, counts, fusion settings
and a sha256 of every file. It is written atomically (a crash leaves the previous
index in place) and every load re-checks it, so a missing, truncated, swapped or mismatched file
is an :class:`ArtifactError` that names it rather than wrong search results.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import faiss
import numpy as np

from specrag.atomic import atomic_directory, reading_directory, sha256_file
from specrag.errors import ArtifactError, InvalidInputError
from specrag.retrieval.arrays import load_array
from specrag.retrieval.backends.local.staged_ivf import DEFAULT_NLIST, StagedIVF
from specrag.retrieval.backends.shards.build import build_hnsw_shards, build_ivf_shards
from specrag.retrieval.backends.shards.merge import ShardedSearcher
from specrag.retrieval.backends.shards.store import load_shards, save_shards, shard_manifests, sharded
from specrag.retrieval.corpus import Passage
from specrag.retrieval.embedders.embedder import (
    DEFAULT_DIM,
    METRIC,
    Embedder,
    TfidfSvdEmbedder,
    load_embedder,
)
from specrag.retrieval.index_files import INDEX_FILE, MANIFEST_FILE, read_manifest, verify_files
from specrag.retrieval.lexical.bm25 import LexicalIndex
from specrag.retrieval.lexical.fusion import DEFAULT_DEPTH, DEFAULT_RRF_K, FusionConfig
from specrag.retrieval.progress import embed_in_batches
from specrag.retrieval.search.search_runner import SearchRunner
from specrag.retrieval.search.stages import StagedSearcher
from specrag.retrieval.synthetic import pad_with_synthetic
from specrag.retrieval.text import normalize_text
from specrag.retrieval.vector_index import VectorIndex

__all__ = [
    "BUILT_IN_EMBEDDERS",
    "EMBEDDER_ENV",
    "FORMAT",
    "HNSW_KIND",
    "INDEX_FILE",
    "IVF_KINDS",
    "KINDS",
    "MANIFEST_FILE",
    "MINILM",
    "PASSAGE_IDS_FILE",
    "SOURCES_FILE",
    "TFIDF_SVD",
    "VERSION",
    "WORDLLAMA",
    "IndexConfig",
    "build_index",
    "build_searcher",
    "built_corpus_checksum",
    "built_passage_ids",
    "check_corpus",
    "default_embedder",
    "describe_embedder",
    "expected_embedder",
    "load_index",
    "passage_ids_digest",
    "recorded_embedder",
    "save_index",
]

FORMAT = "specrag-index"
# 2: hybrid indexes (a lexical index and fusion settings in the manifest), WordLlama by default.
# 3: both channels index the passages' text as specrag.retrieval.text normalises it; an index of
#    an earlier version is rebuilt (ensure_index) rather than searched with normalised questions.
VERSION = 3
PASSAGE_IDS_FILE = "passage_ids.json"
_MANIFEST_KEYS = {"format", "version", "metric", "dim", "ntotal", "num_passages", "searcher", "embedder"}
_MANIFEST_KEYS |= {"lexical", "fusion", "files"}
SOURCES_FILE = "synthetic_sources.npy"
if TYPE_CHECKING:
    from specrag.retrieval.backends.local.staged_hnsw import StagedHNSW

HNSW_KIND = "hnsw"
# The IVF kinds name their list codes (see staged_ivf.IVF_CODES): "ivf" is flat.
IVF_KINDS = {"ivf": "flat", "ivf-pq": "pq", "ivf-sq8": "sq8"}
KINDS = (*IVF_KINDS, HNSW_KIND)
MINILM = "minilm"
WORDLLAMA = "wordllama"
TFIDF_SVD = "tfidf-svd"
# Embedders specrag ships (the first is the default); others (a model directory, a server) are
# passed in. WordLlama and TF-IDF are fitted on the corpus at build time, MiniLM is used as it is.
BUILT_IN_EMBEDDERS = (MINILM, WORDLLAMA, TFIDF_SVD)
# Names the built-in embedder of an index built without one (a test session's cheap WordLlama).
EMBEDDER_ENV = "SPECRAG_EMBEDDER"


def default_embedder() -> str:
    """The built-in embedder an index is built with unless told: ``$SPECRAG_EMBEDDER``, else MiniLM."""
    return os.environ.get(EMBEDDER_ENV) or MINILM


@dataclass(frozen=True)
class IndexConfig:
    """How to build an index. ``pad_to`` adds synthetic rows (mapped to passages) up to that many.

    The default is the hybrid configuration the evaluation in docs/retrieval.md chose: MiniLM vectors
    (``embedding_dim`` applies to ``tfidf-svd`` only) in staged IVF, fused with BM25; the
    embedder's default is :func:`default_embedder`'s.
    """

    kind: str = "ivf"
    embedder: str = field(default_factory=default_embedder)
    lexical: bool = True
    rrf_k: int = DEFAULT_RRF_K
    fusion_depth: int = DEFAULT_DEPTH
    nlist: int = DEFAULT_NLIST
    nprobe: int | None = None
    pq_m: int = 16
    hnsw_m: int = 32
    ef_construction: int = 40
    ef_search: int = 128
    embedding_dim: int = DEFAULT_DIM
    pad_to: int | None = None
    seed: int = 0
    shards: int = 1

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise InvalidInputError(f"the shard count must be at least 1, got {self.shards}")
        if self.kind not in KINDS:
            raise InvalidInputError(f"unknown index kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.embedder not in BUILT_IN_EMBEDDERS:
            raise InvalidInputError(
                f"unknown embedder {self.embedder!r} (--embedder or ${EMBEDDER_ENV}); choose one of "
                f"{', '.join(BUILT_IN_EMBEDDERS)}"
            )
        FusionConfig(self.rrf_k, self.fusion_depth)  # validates

    @property
    def fusion(self) -> FusionConfig:
        return FusionConfig(self.rrf_k, self.fusion_depth)

    def fit(self, texts: Sequence[str]) -> Embedder:
        """The configured embedder, fitted on the corpus' texts where it is fitted at all."""
        if self.embedder == TFIDF_SVD:
            return TfidfSvdEmbedder.fit(texts, dim=self.embedding_dim, seed=self.seed)
        if self.embedder == WORDLLAMA:
            from specrag.retrieval.embedders.wordllama_embedder import WordLlamaEmbedder

            return WordLlamaEmbedder.fit(texts)
        from specrag.retrieval.embedders.minilm_embedder import MiniLMEmbedder

        return MiniLMEmbedder()

    def fit_and_embed(self, texts: Sequence[str], progress: bool = False) -> tuple[Embedder, np.ndarray]:
        """The configured embedder, fitted on the corpus' texts, and their vectors."""
        if self.embedder == WORDLLAMA:  # one tokenization for fitting and embedding: most of its cost
            from specrag.retrieval.embedders.wordllama_embedder import WordLlamaEmbedder

            return WordLlamaEmbedder.fit_embed(texts, progress)
        embedder = self.fit(texts)
        return embedder, embed_in_batches(embedder, texts, show=progress)

    def embedder_mismatch(self, recorded: Mapping[str, Any] | None) -> str | None:
        """Why an index whose manifest records the embedder ``recorded`` (None: no index) was not
        embedded by this configuration's embedder (kind and weights), or None."""
        if recorded is None:
            return None
        expected = expected_embedder(self.embedder)
        if all(recorded.get(key) == value for key, value in expected.items()):
            return None
        return (
            f"the index was embedded by {describe_embedder(recorded)}, "
            f"the query embedder is {describe_embedder(expected)}"
        )

    def mismatch(self, index: VectorIndex) -> str | None:
        """Why ``index`` was not built with this configuration's channels, or None (its embedder
        is compared, before it is loaded, by :meth:`embedder_mismatch`)."""
        if index.hybrid != self.lexical:
            return "the index is " + ("hybrid" if index.hybrid else "dense only") + ", the configuration not"
        return None


def expected_embedder(name: str) -> dict[str, Any]:
    """What a manifest records of the built-in embedder ``name`` as this installation has it: its
    kind and, for one with pretrained weights, their sha256 (loading them if not loaded yet)."""
    if name == MINILM:
        from specrag.retrieval.embedders.minilm_embedder import MiniLMEmbedder, minilm_weights

        return {"kind": MiniLMEmbedder.kind, "weights_sha256": minilm_weights().sha256}
    if name == WORDLLAMA:
        from specrag.retrieval.embedders.wordllama_embedder import WordLlamaEmbedder, token_vectors

        return {"kind": WordLlamaEmbedder.kind, "weights_sha256": sha256_file(token_vectors().weights_file)}
    if name == TFIDF_SVD:
        return {"kind": TfidfSvdEmbedder.kind}
    raise InvalidInputError(f"unknown embedder {name!r}; choose one of {', '.join(BUILT_IN_EMBEDDERS)}")


def describe_embedder(entry: Mapping[str, Any]) -> str:
    """An embedder's manifest entry in a message: its kind, and its weights' checksum if any."""
    weights = entry.get("weights_sha256")
    return str(entry.get("kind")) + (f" (weights sha256 {str(weights)[:12]}…)" if weights else "")


def _staged_hnsw() -> type[StagedHNSW]:
    """The HNSW searcher class, imported only when an HNSW index is used.

    It pulls in numba, and a numba (llvmlite) object in ``sys.modules`` makes vLLM's CPU worker
    fail at start-up (its Triton kernel rebinding calls ``vars()`` on every module attribute).
    A script whose main module imports specrag for IVF must not load numba by the way.
    """
    from specrag.retrieval.backends.local.staged_hnsw import StagedHNSW

    return StagedHNSW


def build_searcher(vectors: np.ndarray, config: IndexConfig, progress: bool = False) -> StagedSearcher:
    """A staged searcher over ``vectors`` (row i = vector i) as ``config`` describes: with
    ``config.shards`` above 1, shards of it (:mod:`specrag.retrieval.backends.shards`)."""
    if config.shards > 1:
        return _build_shards(vectors, config)
    if config.kind == HNSW_KIND:
        return _staged_hnsw().build(
            vectors,
            m=config.hnsw_m,
            ef_construction=config.ef_construction,
            ef_search=config.ef_search,
            progress=progress,
        )
    return StagedIVF.build(
        vectors,
        nlist=config.nlist,
        nprobe=config.nprobe,
        codes=IVF_KINDS[config.kind],
        pq_m=config.pq_m,
        seed=config.seed,
        progress=progress,
    )


def _build_shards(vectors: np.ndarray, config: IndexConfig) -> ShardedSearcher:
    if config.kind == HNSW_KIND:
        return build_hnsw_shards(
            vectors,
            config.shards,
            m=config.hnsw_m,
            ef_construction=config.ef_construction,
            ef_search=config.ef_search,
        )
    return build_ivf_shards(
        vectors,
        config.shards,
        nlist=config.nlist,
        nprobe=config.nprobe,
        codes=IVF_KINDS[config.kind],
        pq_m=config.pq_m,
        seed=config.seed,
    )


def passage_ids_digest(passage_ids: Sequence[str]) -> str:
    """A checksum of the passage ids in row order, to tell whether a corpus matches an index."""
    return hashlib.sha256("\n".join(passage_ids).encode("utf-8")).hexdigest()


def build_index(
    passages: Sequence[Passage], config: IndexConfig, embedder: Embedder | None = None, progress: bool = False
) -> VectorIndex:
    """Embed ``passages`` (fitting the configured embedder on them unless one is given) and index them.

    With ``config.lexical`` the passages' text is also indexed by BM25 for hybrid search. Both
    channels index the text normalised as questions are (:func:`normalize_text`).
    """
    if not passages:
        raise InvalidInputError("cannot build an index from an empty corpus")
    texts = [normalize_text(f"{passage.title}\n{passage.text}") for passage in passages]
    if embedder is None:
        embedder, vectors = config.fit_and_embed(texts, progress)
    else:
        vectors = embed_in_batches(embedder, texts, show=progress)
    lexical = LexicalIndex.build(texts) if config.lexical else None
    sources = None
    if config.pad_to is not None and config.pad_to > len(vectors):
        vectors, sources = pad_with_synthetic(vectors, config.pad_to, seed=config.seed)
    searcher = build_searcher(vectors, config, progress=progress)
    return VectorIndex(
        searcher,
        [passage.id for passage in passages],
        sources,
        embedder,
        lexical=lexical,
        fusion=config.fusion,
    )


def save_index(index: VectorIndex, directory: Path, corpus_checksum: str | None = None) -> None:
    """Write ``index`` to ``directory`` atomically, replacing what was there.

    ``corpus_checksum`` (of the passages' ids, titles and texts) is recorded when given, so that a
    corpus whose texts changed under the same ids is told from the one the index was built on.
    """
    if index.embedder is None:
        raise InvalidInputError("an index is saved with its embedder; this one has none")
    with atomic_directory(directory) as staging:
        searcher_files = _write_searcher(index.searcher, staging)
        (staging / PASSAGE_IDS_FILE).write_text(
            json.dumps(index.passage_ids, ensure_ascii=False), encoding="utf-8"
        )
        np.save(staging / SOURCES_FILE, index.synthetic_sources, allow_pickle=False)
        embedder_entry = index.embedder.save(staging)
        lexical_entry = index.lexical.save(staging) if index.lexical is not None else None
        files = [
            *searcher_files,
            PASSAGE_IDS_FILE,
            SOURCES_FILE,
            *embedder_entry["files"],
            *(lexical_entry["files"] if lexical_entry else []),
        ]
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "metric": METRIC,
            "dim": index.dim,
            "ntotal": index.searcher.ntotal,
            "num_passages": len(index.passage_ids),
            "passage_ids_sha256": passage_ids_digest(index.passage_ids),
            "corpus_sha256": corpus_checksum,
            "searcher": index.searcher.settings,
            "embedder": embedder_entry,
            "lexical": lexical_entry,
            "fusion": asdict(index.fusion),
            "files": {name: sha256_file(staging / name) for name in files},
        }
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _write_searcher(searcher: StagedSearcher, staging: Path) -> list[str]:
    """Write the searcher into the index version ``staging``: one faiss index, or a sharded
    index's shard directories; returns the files the manifest checksums."""
    if sharded(searcher.settings):
        return save_shards(cast(ShardedSearcher, searcher), staging)
    faiss.write_index(searcher.owner, str(staging / INDEX_FILE))
    return [INDEX_FILE]


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise ArtifactError(f"index manifest not found: {path} (build it with `specrag index build`)")
    manifest = read_manifest(path, "index manifest", _MANIFEST_KEYS)
    if (manifest["format"], manifest["version"], manifest["metric"]) != (FORMAT, VERSION, METRIC):
        raise ArtifactError(f"{path}: unsupported index format {manifest['format']} v{manifest['version']}")
    return manifest


def _searcher_from(index: faiss.Index, settings: dict[str, Any], path: Path) -> StagedSearcher:
    if settings.get("kind") == HNSW_KIND and isinstance(index, faiss.IndexHNSWFlat):
        return _staged_hnsw()(index, ef_search=int(settings["ef_search"]))
    if settings.get("kind") == StagedIVF.kind and isinstance(index, faiss.IndexIVF):
        return StagedIVF(index, nprobe=int(settings["nprobe"]))
    raise ArtifactError(f"{path}: a {type(index).__name__} does not match the manifest's {settings}")


def _read_searcher(directory: Path, manifest: dict[str, Any], shard_vectors: bool) -> StagedSearcher:
    """The searcher of the index version in ``directory``, as its ``manifest`` says; a sharded
    one as its shards' manifests only unless ``shard_vectors``."""
    settings = manifest["searcher"]
    if sharded(settings):
        if shard_vectors:
            return load_shards(directory, settings)
        return shard_manifests(directory, settings, int(manifest["dim"]), METRIC == "inner_product")
    index_path = directory / INDEX_FILE
    try:
        # faiss returns the concrete class, owning its memory: keep this object, not a downcast copy.
        raw = faiss.read_index(str(index_path))
    except RuntimeError as error:
        raise ArtifactError(f"cannot read faiss index {index_path}: {error}") from error
    return _searcher_from(raw, settings, index_path)


def load_index(
    directory: Path,
    runner: SearchRunner | None = None,
    *,
    shard_vectors: bool = True,
    embedded_by: Callable[[Mapping[str, Any]], Embedder] | None = None,
) -> VectorIndex:
    """Load and check an index directory written by :func:`save_index`.

    Everything is read from the one version the directory's pointer names, held while it loads,
    so an index replaced meanwhile is read whole, old or new (:func:`reading_directory`). Without
    ``shard_vectors`` a sharded index's shards are read as their checksummed manifests only
    (:func:`~specrag.retrieval.backends.shards.store.shard_manifests`): a controller whose shards live in
    actors (``serve --search-shards``) never holds their vectors, and searches through the actors.
    ``embedded_by`` gives the embedder of the recorded entry instead of loading it (an embedding
    server's for ``serve --embedder openai``: the recorded model is then never loaded here).
    """
    with reading_directory(directory) as version:
        return _load_version(
            version, runner, shard_vectors, embedded_by or functools.partial(load_embedder, version)
        )


def _load_version(
    directory: Path,
    runner: SearchRunner | None,
    shard_vectors: bool,
    embedded_by: Callable[[Mapping[str, Any]], Embedder],
) -> VectorIndex:
    manifest = _read_manifest(directory)
    verify_files(directory, manifest["files"])
    searcher = _read_searcher(directory, manifest, shard_vectors)
    if (searcher.dim, searcher.ntotal) != (manifest["dim"], manifest["ntotal"]):
        where = directory if sharded(manifest["searcher"]) else directory / INDEX_FILE
        raise ArtifactError(
            f"{where}: {searcher.ntotal} × {searcher.dim} vectors, manifest says "
            f"{manifest['ntotal']} × {manifest['dim']}"
        )
    ids_path = directory / PASSAGE_IDS_FILE
    try:
        passage_ids = json.loads(ids_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ArtifactError(f"cannot read passage ids {ids_path}: {error}") from error
    if len(passage_ids) != manifest["num_passages"] or passage_ids_digest(passage_ids) != manifest.get(
        "passage_ids_sha256"
    ):
        raise ArtifactError(f"{ids_path}: passage ids do not match the manifest")
    embedder = embedded_by(manifest["embedder"])
    if embedder.dim != searcher.dim:
        raise ArtifactError(
            f"{directory}: embedder gives {embedder.dim} dimensions, index has {searcher.dim}"
        )
    lexical = LexicalIndex.load(directory, manifest["lexical"]) if manifest["lexical"] else None
    try:
        fusion = FusionConfig(**manifest["fusion"])
    except (TypeError, InvalidInputError) as error:
        raise ArtifactError(f"{directory / MANIFEST_FILE}: bad fusion {manifest['fusion']}") from error
    try:
        return VectorIndex(
            searcher, passage_ids, load_array(directory / SOURCES_FILE), embedder, runner, lexical, fusion
        )
    except InvalidInputError as error:
        raise ArtifactError(f"{directory}: {error}") from error


def built_passage_ids(directory: Path) -> list[str] | None:
    """The passage ids, in row order, of the index in ``directory``, or None when there is no
    intact one. Reads only the manifest and the ids (not the index): what a changed corpus is
    compared with before anything is rebuilt."""
    try:
        with reading_directory(directory) as version:
            manifest = _read_manifest(version)
            verify_files(version, {PASSAGE_IDS_FILE: manifest["files"][PASSAGE_IDS_FILE]})
            passage_ids = json.loads((version / PASSAGE_IDS_FILE).read_text(encoding="utf-8"))
    except (ArtifactError, KeyError, OSError, ValueError):
        return None
    if not isinstance(passage_ids, list) or not all(isinstance(found, str) for found in passage_ids):
        return None
    return passage_ids


def recorded_embedder(directory: Path) -> dict[str, Any] | None:
    """The embedder entry of the manifest in ``directory``, or None when there is no readable one:
    what a query embedder is compared with before the index (and its embedder) is loaded."""
    try:
        with reading_directory(directory) as version:
            entry = _read_manifest(version)["embedder"]
    except ArtifactError:
        return None
    return entry if isinstance(entry, dict) else None


def built_corpus_checksum(directory: Path) -> str | None:
    """The corpus checksum the index in ``directory`` recorded (:func:`save_index`), or None."""
    try:
        with reading_directory(directory) as version:
            recorded = _read_manifest(version).get("corpus_sha256")
    except ArtifactError:
        return None
    return recorded if isinstance(recorded, str) else None


def check_corpus(index: VectorIndex, passages: Sequence[Passage]) -> None:
    """Raise ArtifactError unless ``passages`` are the corpus the index was built from, in order."""
    if passage_ids_digest([p.id for p in passages]) != passage_ids_digest(index.passage_ids):
        raise ArtifactError(
            f"the corpus ({len(passages)} passages) is not the one the index was built from "
            f"({len(index.passage_ids)} passages): rebuild the index"
        )
