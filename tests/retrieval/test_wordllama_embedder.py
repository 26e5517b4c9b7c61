"""The fast static embedder: WordLlama's weights from its wheel, loaded with no network access."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from specrag.errors import ArtifactError
from specrag.retrieval.embedders import wordllama_embedder
from specrag.retrieval.embedders.embedder import load_embedder
from specrag.retrieval.embedders.wordllama_embedder import WordLlamaEmbedder, token_vectors
from tests.helpers.network import NetworkUsed, forbid_network

TEXTS = [
    "The event loop runs coroutines and callbacks.",
    "A dictionary maps hashable keys to values.",
    "Open a file and read its lines.",
    "",
]


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    forbid_network(monkeypatch)
    token_vectors.cache_clear()
    yield
    token_vectors.cache_clear()


def test_the_guard_catches_a_connection(no_network: None) -> None:
    with pytest.raises(NetworkUsed):
        socket.create_connection(("127.0.0.1", 9))
    with pytest.raises(NetworkUsed), socket.socket() as raw:
        raw.connect(("127.0.0.1", 9))


def test_weights_load_and_embed_without_network(no_network: None) -> None:
    embedder = WordLlamaEmbedder.fit(TEXTS)
    vectors = embedder.embed(TEXTS)
    assert vectors.shape == (4, 256) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors[:3], axis=1), 1.0, rtol=1e-5)
    assert not vectors[3].any()  # an empty text has no tokens: a zero vector, not NaN
    package_dir = Path(wordllama_embedder.import_wordllama().__file__).resolve().parent
    assert token_vectors().weights_file.is_relative_to(package_dir)


def test_uniform_weights_give_the_packages_own_embedding() -> None:
    model = wordllama_embedder.import_wordllama().WordLlama.load(
        cache_dir=token_vectors().weights_file.parent.parent, disable_download=True
    )
    uniform = WordLlamaEmbedder(np.ones(token_vectors().table.shape[0]))
    np.testing.assert_allclose(uniform.embed(TEXTS[:3]), model.embed(TEXTS[:3], norm=True), atol=1e-5)


def test_idf_weights_favour_rare_tokens() -> None:
    embedder = WordLlamaEmbedder.fit(TEXTS)

    def token(word: str) -> int:
        (only,) = token_vectors().tokenizer.encode(word, add_special_tokens=False).ids
        return int(only)

    # "and" is in two texts, "dictionary" in one, "the" (lower case) in none.
    assert embedder.idf[token("and")] < embedder.idf[token("dictionary")] < embedder.idf[token("the")]


def test_save_load_gives_identical_vectors(tmp_path: Path, no_network: None) -> None:
    embedder = WordLlamaEmbedder.fit(TEXTS)
    entry = embedder.save(tmp_path)
    assert not (tmp_path / entry["files"][0]).read_bytes().startswith(b"\x80")  # no pickle
    loaded = load_embedder(tmp_path, json.loads(json.dumps(entry)))
    np.testing.assert_array_equal(loaded.embed(TEXTS), embedder.embed(TEXTS))


def test_other_weights_or_a_damaged_file_are_artifact_errors(tmp_path: Path) -> None:
    entry = WordLlamaEmbedder.fit(TEXTS).save(tmp_path)
    with pytest.raises(ArtifactError, match="rebuild the index"):
        load_embedder(tmp_path, {**entry, "weights_sha256": "0" * 64})
    np.save(tmp_path / entry["files"][0], np.ones(3), allow_pickle=False)
    with pytest.raises(ArtifactError, match=entry["files"][0]):
        load_embedder(tmp_path, entry)


def test_fitting_and_embedding_in_one_pass_gives_the_same_vectors() -> None:
    texts = [*TEXTS, *(f"passage {n} about sockets and threads" for n in range(5000))]
    embedder, vectors = WordLlamaEmbedder.fit_embed(texts)  # more texts than one fitting chunk
    np.testing.assert_array_equal(embedder.idf, WordLlamaEmbedder.fit(texts).idf)
    np.testing.assert_allclose(vectors, embedder.embed(texts), atol=1e-6)
