"""The default embedder: all-MiniLM-L6-v2 from its wheel's files, with no network; its identity."""

from __future__ import annotations

import hashlib
import json
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from specrag.errors import ArtifactError
from specrag.retrieval.corpus import Passage
from specrag.retrieval.embedders import minilm_embedder
from specrag.retrieval.embedders.embedder import load_embedder
from specrag.retrieval.embedders.minilm_embedder import (
    BFLOAT16,
    DIM,
    FLOAT32,
    MiniLMEmbedder,
    load_weights,
    minilm_weights,
    model_zip,
)
from specrag.retrieval.index_store import (
    EMBEDDER_ENV,
    MANIFEST_FILE,
    WORDLLAMA,
    IndexConfig,
    build_index,
    load_index,
    recorded_embedder,
    save_index,
)
from tests.helpers.network import forbid_network

pytest.importorskip("transformers", reason="MiniLM runs on torch and transformers (the engine's)")
torch = pytest.importorskip("torch")

TEXTS = [
    "How do I open a file for reading?",
    "Open a file and return a stream; the mode r reads text.",
    "The event loop runs coroutines and callbacks.",
    "",
    "A dictionary maps hashable keys to values. " * 60,  # longer than the 256 word pieces kept
]


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder()


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No network, and Hugging Face's libraries told so too; the weights loaded afresh."""
    forbid_network(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    load_weights.cache_clear()
    yield
    load_weights.cache_clear()


def test_the_wheels_weights_load_and_embed_without_network(offline: None) -> None:
    embedder = MiniLMEmbedder()
    vectors = embedder.embed(TEXTS)
    assert vectors.shape == (len(TEXTS), DIM) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    with zipfile.ZipFile(model_zip()) as archive:
        assert minilm_weights().sha256 == hashlib.sha256(archive.read("model.safetensors")).hexdigest()


def test_a_question_is_nearest_its_paraphrase(embedder: MiniLMEmbedder) -> None:
    """Contextual: the question shares only "open" and "file" with its answer, yet ranks it first."""
    question, answer, other = embedder.embed(TEXTS[:3])
    assert question @ answer > 0.5 > question @ other


def test_batches_by_length_give_each_text_its_own_vector() -> None:
    """Padding a text to a batch's longest changes nothing (mean over the attention mask), and
    the length order is undone: each row is the vector of the text at that row (in float32, whose
    sums do not depend on the batch's shape to more than a rounding)."""
    embedder = MiniLMEmbedder(minilm_weights(FLOAT32))
    alone = np.concatenate([embedder.embed([text]) for text in TEXTS])
    np.testing.assert_allclose(embedder.embed(TEXTS), alone, atol=1e-5)
    np.testing.assert_allclose(embedder.embed(TEXTS[::-1]), alone[::-1], atol=1e-5)


def test_bfloat16_gives_the_float32_vectors_to_a_rounding(embedder: MiniLMEmbedder) -> None:
    full = MiniLMEmbedder(minilm_weights(FLOAT32)).embed(TEXTS)
    half = MiniLMEmbedder(minilm_weights(BFLOAT16)).embed(TEXTS)
    assert half.dtype == np.float32
    assert np.einsum("ij,ij->i", full, half).min() > 0.99
    entry = MiniLMEmbedder(minilm_weights(BFLOAT16)).save(Path("."))
    assert entry["precision"] == BFLOAT16 and entry["weights_sha256"] == minilm_weights(FLOAT32).sha256


def test_the_manifest_records_the_weights_and_other_weights_are_refused(
    embedder: MiniLMEmbedder, tmp_path: Path
) -> None:
    entry = embedder.save(tmp_path)
    assert entry["weights_sha256"] == minilm_weights().sha256 and entry["model"] == "all-MiniLM-L6-v2"
    loaded = load_embedder(tmp_path, json.loads(json.dumps(entry)))
    np.testing.assert_array_equal(loaded.embed(TEXTS[:2]), embedder.embed(TEXTS[:2]))
    installed = minilm_weights().sha256[:12]
    with pytest.raises(ArtifactError, match=rf"sha256 000000000000.*sha256 {installed}.*rebuild the index"):
        load_embedder(tmp_path, {**entry, "weights_sha256": "0" * 64})


def test_an_index_is_embedded_by_minilm_by_default(
    embedder: MiniLMEmbedder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(EMBEDDER_ENV)  # the test session's default is WordLlama
    passages = [Passage(f"p{n}", f"Title {n}", text) for n, text in enumerate(TEXTS[:3] * 4)]
    save_index(build_index(passages, IndexConfig(nlist=2)), tmp_path / "index")
    manifest = json.loads((tmp_path / "index" / MANIFEST_FILE).read_text(encoding="utf-8"))
    assert manifest["embedder"]["kind"] == "minilm" and manifest["dim"] == DIM
    assert recorded_embedder(tmp_path / "index") == manifest["embedder"]
    assert IndexConfig().embedder_mismatch(manifest["embedder"]) is None
    mismatch = IndexConfig(embedder=WORDLLAMA).embedder_mismatch(manifest["embedder"])
    assert mismatch is not None and "minilm (weights sha256" in mismatch and "wordllama-idf" in mismatch
    assert load_index(tmp_path / "index").embedder is not None
    monkeypatch.setenv(EMBEDDER_ENV, WORDLLAMA)
    assert IndexConfig().embedder == WORDLLAMA


def test_a_build_runs_one_batch_per_core_each_on_one_thread(
    embedder: MiniLMEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several batches at once, each pass on one torch thread, and the vectors each text gets
    embedded alone in the same precision (the schedule changes no vector)."""
    alone = np.concatenate([embedder.embed([text]) for text in TEXTS])
    seen: list[tuple[str, int]] = []
    one_batch = embedder._embed_batch

    def recorded(texts: list[str]) -> np.ndarray:
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return one_batch(texts)

    monkeypatch.setattr(minilm_embedder, "BATCH", 1)
    monkeypatch.setattr(minilm_embedder.os, "sched_getaffinity", lambda _: {0, 1})
    monkeypatch.setattr(embedder, "_embed_batch", recorded)
    np.testing.assert_allclose(embedder.embed(TEXTS), alone, atol=1e-6)
    assert len(seen) == len(TEXTS) and {threads for _, threads in seen} == {1}
    assert len({name for name, _ in seen}) == 2 and threading.current_thread().name not in dict(seen)
