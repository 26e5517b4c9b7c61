"""``serve --embedder openai`` over a local index: an embedding server serving the index's model
embeds the questions and the documents added live, answers as the in-process embedder does, is
refused at start when it serves another model, and a server that does not answer in time is a
504 naming it, never a hang."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from specrag.cli import main
from specrag.client import AsyncClient, SpecragHTTPError
from specrag.paths import DataLayout
from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.retrieval.backends.registry import data_directory
from specrag.retrieval.backends.shards.merge import ShardedSearcher
from specrag.retrieval.corpus import Passage, write_passages
from specrag.retrieval.embedders.http_embedder import OpenAIEmbedder
from specrag.retrieval.embedders.served import MINILM_SERVED_NAMES, ServedEmbedder, served_mismatch
from specrag.retrieval.index_store import MINILM, IndexConfig, recorded_embedder
from specrag.service.http.app import create_app, serving
from specrag.service.run.assets import Assets, ensure_assets, ensure_index
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import make_controller
from tests.helpers.embedding_server import embedding_stand_in
from tests.helpers.live_corpus import QUOKKA_FACT, QUOKKA_QUESTION

pytest.importorskip("transformers", reason="MiniLM runs on torch and transformers (the engine's)")

MODEL = MINILM_SERVED_NAMES[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, default_corpus: list[Passage]) -> tuple[DataLayout, Path]:
    """A data directory whose corpus (a few passages) the in-process MiniLM will embed."""
    root = tmp_path_factory.mktemp("served")
    corpus = root / "corpus.jsonl"
    write_passages(corpus, default_corpus[:24])
    return DataLayout(root / "data"), corpus


def assets_of(data: tuple[DataLayout, Path], model: Path, server: OpenAIEmbedder | None = None) -> Assets:
    assets = ensure_assets(data[0], model, data[1], backend=data_directory(MINILM, query_embedder=server))
    return assets


def stop_writing(assets: Assets) -> None:
    """The next assets of the data directory write its documents log."""
    assert isinstance(assets.corpus, LiveCorpus)
    assets.corpus.store.stop_writing()


async def documents_of(assets: Assets, questions: list[str]) -> list[list[str]]:
    controller = make_controller(SimulatedEngine(time_scale=0.01, max_model_len=4096), assets)
    try:
        async with serving(create_app(controller), access_log=False) as url, AsyncClient(url) as client:
            answers = [await client.rag(q, k=4, mode="serial", max_tokens=2) for q in questions]
    finally:
        await controller.close()
    return [list(answer.documents) for answer in answers]


def test_served_questions_and_documents_are_answered_as_in_process(
    data: tuple[DataLayout, Path],
    tiny_model_dir: Path,
    default_corpus: list[Passage],
    minilm_embedder: Any,
    embedding_clients: list[OpenAIEmbedder],
) -> None:
    questions = [f"What does {passage.title} say?" for passage in default_corpus[:24:6]]
    in_process = assets_of(data, tiny_model_dir)
    expected = asyncio.run(documents_of(in_process, questions))
    stop_writing(in_process)
    with embedding_stand_in(minilm_embedder, precompute=tuple(questions)) as server:
        embedding_clients.append(OpenAIEmbedder(server.url, MODEL))
        served = assets_of(data, tiny_model_dir, embedding_clients[-1])
        assert isinstance(served.index.embedder, ServedEmbedder)
        assert served.index.embedder.kind == MINILM  # the index's, so its documents log is checked
        assert asyncio.run(documents_of(served, questions)) == expected
        assert served.corpus is not None
        served.corpus.put([Passage("quokka", "quokka module", QUOKKA_FACT)])  # embedded by the server
        assert asyncio.run(documents_of(served, [QUOKKA_QUESTION]))[0][0] == "quokka"
        # The probe, the question and the document, none of them named at start.
        assert server.stats()["computed_while_serving"] == 3
        stop_writing(served)


def test_a_server_of_another_model_is_refused_at_start(
    data: tuple[DataLayout, Path],
    tiny_model_dir: Path,
    minilm_embedder: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assets_of(data, tiny_model_dir)  # the index, embedded in process
    with embedding_stand_in(minilm_embedder, model="other-model") as server:
        common = ["--data-dir", str(data[0].root), "--model", str(tiny_model_dir), "--port", "0"]
        served = ["--embedder", "openai", "--embedder-url", server.url, "--embedder-model", "other-model"]
        assert main(["serve", *common, *served]) == 2
    error = capsys.readouterr().err
    assert "minilm model 'sentence-transformers/all-MiniLM-L6-v2'" in error and "'other-model'" in error
    assert server.url in error


def test_the_manifest_decides_which_servers_may_embed(embedding_clients: list[OpenAIEmbedder]) -> None:
    def server(model: str, dim: int) -> OpenAIEmbedder:  # never asked: its dimension is given
        embedding_clients.append(OpenAIEmbedder("http://127.0.0.1:9", model, dim=dim))
        return embedding_clients[-1]

    minilm_entry = {"kind": "minilm", "dim": 384}
    assert served_mismatch(minilm_entry, server(MINILM_SERVED_NAMES[1], 384)) is None
    assert served_mismatch(None, server(MODEL, 384)) is None  # no index yet: the server will embed it
    assert "384 dimensions" in str(served_mismatch(minilm_entry, server(MODEL, 768)))
    assert "no server serves" in str(served_mismatch({"kind": "wordllama-idf", "dim": 64}, server(MODEL, 64)))
    bge = {"kind": "openai", "model": "bge-small", "dim": 384}
    assert served_mismatch(bge, server("bge-small", 384)) is None
    assert "'bge-small'" in str(served_mismatch(bge, server("bge-large", 384)))


def test_a_server_that_does_not_answer_in_time_is_a_504_naming_it(
    data: tuple[DataLayout, Path],
    tiny_model_dir: Path,
    minilm_embedder: Any,
    embedding_clients: list[OpenAIEmbedder],
) -> None:
    with (
        embedding_stand_in(minilm_embedder) as server,
        embedding_stand_in(minilm_embedder, batch_s=5.0) as slow,
    ):
        embedding_clients.append(OpenAIEmbedder(server.url, MODEL))  # the start re-embeds a logged document
        served = assets_of(data, tiny_model_dir, embedding_clients[-1])
        embedding_clients.append(OpenAIEmbedder(slow.url, MODEL, dim=384, timeout_s=0.3))
        served.index.embedder = ServedEmbedder(embedding_clients[-1], {"kind": MINILM, "dim": 384})
        try:
            with pytest.raises(SpecragHTTPError) as refused:
                asyncio.run(documents_of(served, [QUOKKA_QUESTION]))
        finally:
            stop_writing(served)
    assert refused.value.status == 504
    assert "embedding server" in str(refused.value) and slow.url in str(refused.value)


def test_a_sharded_index_serve_builds_is_embedded_and_searched_through_the_server(
    tmp_path: Path,
    default_corpus: list[Passage],
    data: tuple[DataLayout, Path],
    tiny_model_dir: Path,
    minilm_embedder: Any,
    embedding_clients: list[OpenAIEmbedder],
) -> None:
    passages = default_corpus[:24]
    questions = [f"What does {passage.title} say?" for passage in passages[1:24:7]]
    assets = assets_of(data, tiny_model_dir)
    stop_writing(assets)
    in_process = assets.index  # unsharded, embedded in process
    with embedding_stand_in(minilm_embedder) as server:
        embedding_clients.append(OpenAIEmbedder(server.url, MODEL))
        layout = DataLayout(tmp_path / "data")
        sharded = ensure_index(
            layout, passages, IndexConfig(nlist=2, shards=2), query_embedder=embedding_clients[-1]
        )
        recorded = recorded_embedder(layout.index_dir) or {}
        assert (recorded.get("kind"), recorded.get("model"), recorded.get("dim")) == ("openai", MODEL, 384)
        assert isinstance(sharded.searcher, ShardedSearcher)
        assert isinstance(sharded.embedder, ServedEmbedder) and sharded.embedder.kind == "openai"
        for question in questions:
            _, expected = in_process.search(in_process.embed_query(question), 4, query_text=question)
            _, found = sharded.search(sharded.embed_query(question), 4, query_text=question)
            assert in_process.passage_ids_of(expected) == sharded.passage_ids_of(found)


def test_an_index_served_by_a_server_is_loaded_without_its_recorded_model(
    data: tuple[DataLayout, Path],
    tiny_model_dir: Path,
    minilm_embedder: Any,
    embedding_clients: list[OpenAIEmbedder],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``serve --embedder openai`` over a MiniLM index: the server embeds every question, so the
    index loads without reading MiniLM's weights in this process."""
    from specrag.retrieval.embedders.minilm_embedder import MiniLMEmbedder

    stop_writing(assets_of(data, tiny_model_dir))  # the index, embedded in process

    def refuse(*args: object) -> None:
        raise AssertionError("the recorded MiniLM was loaded although a server embeds the questions")

    monkeypatch.setattr(MiniLMEmbedder, "load", classmethod(refuse))
    with embedding_stand_in(minilm_embedder) as server:
        embedding_clients.append(OpenAIEmbedder(server.url, MODEL))
        served = assets_of(data, tiny_model_dir, embedding_clients[-1])
        assert isinstance(served.index.embedder, ServedEmbedder) and served.index.embedder.kind == MINILM
        stop_writing(served)
