"""Live corpora for the tests: the tiny assets with a live corpus of their own and a fact to add
to it, stand-ins for the embedder and the tokenizer, made-up words, a hybrid corpus of them, and
new documents in those words."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specrag.pipeline.store.document_store import build_store
from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.pipeline.store.live_store import LiveStore
from specrag.retrieval.corpus import Passage
from specrag.retrieval.index_store import TFIDF_SVD, IndexConfig, build_index, load_index
from specrag.service.run.assets import Assets

QUOKKA_QUESTION = "How does the quokka module count marsupials?"
QUOKKA_FACT = "The quokka module counts marsupials with quokka.census() on Rottnest island."


def live_assets(assets: Assets, log: Path) -> Assets:
    """The tiny assets with a live corpus of their own (a fresh index copy, a log in ``log``)."""
    index = load_index(assets.store.path.parent.parent / "index")
    corpus = LiveCorpus.replayed(LiveStore(assets.store.path, log), index, assets.tokenizer.encode_batch)
    return dataclasses.replace(assets, store=corpus.store, index=index, corpus=corpus)


class TableEmbedder:
    """A document's text is ``vec:<n>``: its vector is row n of the table."""

    kind = "table"

    def __init__(self, table: np.ndarray) -> None:
        self.table = table
        self.dim = table.shape[1]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.table[[int(text.rsplit(":", 1)[1]) for text in texts]]

    def save(self, directory: Path) -> dict[str, Any]:
        raise NotImplementedError


def one_token_each(texts: list[str]) -> list[list[int]]:
    return [[len(text)] for text in texts]


def made_up_words(count: int, seed: int) -> list[str]:
    """``count`` distinct pronounceable non-words (no stop words, no stems of each other)."""
    rng = np.random.default_rng(seed)
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    words: dict[str, None] = {}
    while len(words) < count:
        words["".join(rng.choice(list(consonants)) + rng.choice(list(vowels)) for _ in range(3))] = None
    return list(words)


def text_corpus(tmp_path: Path, kind: str, compact_share: float | None = None) -> LiveCorpus[LiveStore]:
    """A live hybrid corpus (TF-IDF vectors and BM25) of 800 documents ``t<i>`` of made-up words,
    on an index of ``kind`` ("ivf" or "hnsw"), tokenized one token a document."""
    words = made_up_words(400, seed=3)
    rng = np.random.default_rng(4)
    passages = [Passage(f"t{i}", "", " ".join(rng.choice(words, 12))) for i in range(800)]
    build_store(tmp_path / "store.sqlite", passages, one_token_each, "stand-in")
    config = IndexConfig(kind=kind, embedder=TFIDF_SVD, nlist=16, hnsw_m=16, ef_search=48, embedding_dim=64)
    index = build_index(passages, config)
    store = LiveStore(tmp_path / "store.sqlite")
    return LiveCorpus.replayed(store, index, one_token_each, compact_share=compact_share)


def new_passages(count: int, seed: int, prefix: str = "new") -> list[Passage]:
    """Documents of ``text_corpus``' own words (the embedder knows no others), in new combinations."""
    rng = np.random.default_rng(seed)
    words = made_up_words(400, seed=3)
    return [Passage(f"{prefix}-{seed}-{i}", "", " ".join(rng.choice(words, 12))) for i in range(count)]
