from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from specrag.errors import ArtifactError, InvalidInputError
from specrag.retrieval.corpus import Passage
from specrag.retrieval.embedders.embedder import SentenceTransformerEmbedder, TfidfSvdEmbedder, load_embedder


def test_vectors_are_unit_length(passages: list[Passage]) -> None:
    embedder = TfidfSvdEmbedder.fit([p.text for p in passages], dim=8)
    vectors = embedder.embed([p.text for p in passages])
    assert vectors.dtype == np.float32 and vectors.shape == (len(passages), 8)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)


def test_save_load_gives_identical_vectors_without_pickle(passages: list[Passage], tmp_path: Path) -> None:
    texts = [p.text for p in passages]
    embedder = TfidfSvdEmbedder.fit(texts, dim=12, seed=3)
    entry = embedder.save(tmp_path)
    for name in entry["files"]:
        assert not (tmp_path / name).read_bytes().startswith(b"\x80")  # no pickle protocol header
    loaded = load_embedder(tmp_path, entry)
    probe = [*texts[:10], "an unseen query about event loops", ""]
    np.testing.assert_array_equal(loaded.embed(probe), embedder.embed(probe))


def test_dimension_is_capped_by_the_corpus() -> None:
    assert TfidfSvdEmbedder.fit(["alpha beta", "beta gamma", "gamma delta"], dim=384).dim == 2


def test_empty_vocabulary_is_a_clear_error() -> None:
    with pytest.raises(InvalidInputError):
        TfidfSvdEmbedder.fit(["a", "b"])
    with pytest.raises(InvalidInputError):
        TfidfSvdEmbedder.fit([])


def test_damaged_embedder_files_are_named(passages: list[Passage], tmp_path: Path) -> None:
    entry = TfidfSvdEmbedder.fit([p.text for p in passages], dim=4).save(tmp_path)
    (tmp_path / "embedder_idf.npy").write_bytes(b"garbage")
    with pytest.raises(ArtifactError, match=r"embedder_idf\.npy"):
        load_embedder(tmp_path, entry)
    with pytest.raises(ArtifactError, match="unknown embedder"):
        load_embedder(tmp_path, {"kind": "word2vec"})


def test_missing_sentence_transformers_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)
    with pytest.raises(InvalidInputError, match="pip install sentence-transformers"):
        SentenceTransformerEmbedder(tmp_path)
