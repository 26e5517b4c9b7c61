"""The lexical channel of hybrid search: BM25 over stemmed words (``bm25s`` + ``PyStemmer``).

Dense embeddings blur the rare words that often name the one right document (a function name,
an error code, a flag); BM25 scores exactly those. ``bm25s`` precomputes every document's score
per vocabulary word into a sparse matrix, so a query costs a few column sums: about a millisecond
on 60,000 short documents, well inside the first stage of a dense search. Row ``i`` of the
lexical index is passage ``i`` of the corpus (synthetic padding rows have no text and no row here).

Saved as ``bm25s`` writes it (JSON vocabulary and parameters, ``.npy`` arrays, never pickles)
into a sub-directory of the index directory, which checks every file against its manifest.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import Stemmer

from specrag.errors import ArtifactError, InvalidInputError
from specrag.retrieval.lexical.identifiers import named_identifiers
from specrag.retrieval.text import normalize_text

if TYPE_CHECKING:
    import bm25s

__all__ = ["ANALYZER", "BM25_PARAMETERS", "SUBDIRECTORY", "LexicalIndex"]


def _bm25s() -> ModuleType:
    """``bm25s``, imported only when a lexical index is built, loaded or searched.

    It imports numba, and a numba (llvmlite) object in ``sys.modules`` makes vLLM's CPU worker
    fail at start-up (its Triton kernel rebinding calls ``vars()`` on every module attribute). A
    script whose main module imports specrag must not load it by the way: vLLM's spawned
    processes import that main module again.

    Importing it sets its logger to DEBUG, which printed its debug lines on every command's
    output; its level is given back to the application's logging configuration (``-v``).
    """
    import bm25s

    logging.getLogger("bm25s").setLevel(logging.NOTSET)
    return bm25s


# How text becomes BM25 terms; recorded in the manifest, since an index only answers queries
# tokenised the way its documents were.
ANALYZER: dict[str, Any] = {"stemmer": "english", "stopwords": "en", "lower": True}
BM25_PARAMETERS: dict[str, Any] = {"method": "lucene", "k1": 1.5, "b": 0.75}
SUBDIRECTORY = "lexical"
# The files bm25s writes for an index without a corpus copy (method "lucene" needs no others).
_FILES = (
    "data.csc.index.npy",
    "indices.csc.index.npy",
    "indptr.csc.index.npy",
    "vocab.index.json",
    "params.index.json",
)


class LexicalIndex:
    """BM25 over the passages of a corpus; :meth:`search` gives passage rows, best first."""

    kind = "bm25"

    def __init__(self, retriever: bm25s.BM25, num_passages: int) -> None:
        self._retriever = retriever
        self.num_passages = num_passages
        self._stemmer = Stemmer.Stemmer(ANALYZER["stemmer"])

    @classmethod
    def build(cls, texts: Sequence[str]) -> LexicalIndex:
        """Index ``texts`` (row i = ``texts[i]``), normalised as :func:`normalize_text` does
        (:func:`~specrag.retrieval.index_store.build_index` gives them so)."""
        if not texts:
            raise InvalidInputError("cannot build a lexical index from zero texts")
        stemmer = Stemmer.Stemmer(ANALYZER["stemmer"])
        bm25s = _bm25s()
        tokens = bm25s.tokenize(
            list(texts),
            lower=ANALYZER["lower"],
            stopwords=ANALYZER["stopwords"],
            stemmer=stemmer,
            show_progress=False,
        )
        retriever = bm25s.BM25(**BM25_PARAMETERS)
        retriever.index(tokens, show_progress=False)
        return cls(retriever, len(texts))

    def terms(self, text: str) -> list[str]:
        """The stemmed, stop-word-free terms BM25 scores ``text`` by, normalised as the corpus was."""
        tokenized = _bm25s().tokenize(
            [normalize_text(text)],
            lower=ANALYZER["lower"],
            stopwords=ANALYZER["stopwords"],
            stemmer=self._stemmer,
            return_ids=False,
            show_progress=False,
        )
        terms: list[str] = tokenized[0]
        return terms

    def query_terms(self, text: str, identifier_weight: int = 1) -> list[str]:
        """The terms a query is scored by: its own, and those of each identifier it names
        (:mod:`~specrag.retrieval.lexical.identifiers`) ``identifier_weight - 1`` times more.

        BM25 sums a score per query term, so a term given n times counts n times (Lucene's
        ``term^n``).
        """
        if identifier_weight < 1:
            raise InvalidInputError(f"identifier_weight must be at least 1, got {identifier_weight}")
        terms = self.terms(text)
        for identifier in named_identifiers(text):
            terms += self.terms(identifier) * (identifier_weight - 1)
        return terms

    def search(
        self, text: str, depth: int, identifier_weight: int = 1, allowed: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The (at most) ``depth`` best passages containing a query term: (rows, scores), best first.

        The identifiers the query names weigh ``identifier_weight`` times their words. Ties are
        broken by row so the ranking is deterministic; a query with no known term finds nothing
        (empty arrays), which leaves a hybrid search to its dense channel. With ``allowed`` (a flag
        per passage) only the passages flagged are ranked: a live index's hidden ones are skipped
        before the ranking is cut, so they cannot push the visible ones out of it.
        """
        if depth < 1:
            raise InvalidInputError(f"depth must be at least 1, got {depth}")
        term_ids = self._retriever.get_tokens_ids(self.query_terms(text, identifier_weight))
        if not term_ids:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        scores = np.asarray(self._retriever.get_scores_from_ids(term_ids), dtype=np.float32)
        matching = np.flatnonzero(scores > 0 if allowed is None else (scores > 0) & allowed[: len(scores)])
        if len(matching) > depth:
            matching = matching[np.argpartition(-scores[matching], depth - 1)[:depth]]
        order = np.lexsort((matching, -scores[matching]))
        rows = matching[order].astype(np.int64)
        return rows, scores[rows]

    def document_frequencies(self) -> dict[str, int]:
        """How many passages hold each term (a live index scores added documents with them)."""
        # bm25s keeps one column per vocabulary term (CSC): its non-zeros are the passages holding it
        # (its vocabulary's empty term, last, has no column).
        counts = np.diff(np.asarray(self._retriever.scores["indptr"]))
        return {
            str(term): int(counts[column])
            for term, column in self._retriever.vocab_dict.items()
            if column < len(counts)
        }

    def save(self, directory: Path) -> dict[str, Any]:
        """Write the index under ``directory/lexical``; return its manifest entry."""
        target = directory / SUBDIRECTORY
        self._retriever.save(str(target), show_progress=False)
        return {
            "kind": self.kind,
            "analyzer": ANALYZER,
            "parameters": BM25_PARAMETERS,
            "num_passages": self.num_passages,
            "files": [f"{SUBDIRECTORY}/{name}" for name in _FILES],
        }

    @classmethod
    def load(cls, directory: Path, entry: Mapping[str, Any]) -> LexicalIndex:
        """Rebuild the index a manifest entry describes (its files' checksums are checked first)."""
        if entry.get("analyzer") != ANALYZER or entry.get("parameters") != BM25_PARAMETERS:
            raise ArtifactError(
                f"{directory}: lexical index built with {entry.get('analyzer')} / {entry.get('parameters')}, "
                f"this version uses {ANALYZER} / {BM25_PARAMETERS}: rebuild the index"
            )
        source = directory / SUBDIRECTORY
        try:
            retriever = _bm25s().BM25.load(str(source), show_progress=False)
            num_passages = int(retriever.scores["num_docs"])
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as error:
            raise ArtifactError(f"cannot read the lexical index in {source}: {error!r}") from error
        if num_passages != entry.get("num_passages"):
            raise ArtifactError(
                f"{source}: {num_passages} passages, manifest says {entry.get('num_passages')}"
            )
        return cls(retriever, num_passages)
