"""The data directory remembers a user's corpus (its model's tokenizer was trained on it)."""

from __future__ import annotations

from pathlib import Path

from specrag.paths import DataLayout
from specrag.retrieval.corpus import Passage, write_passages
from specrag.service.run.assets import ensure_corpus


def test_a_users_corpus_is_kept_for_later_commands_without_corpus(tmp_path: Path) -> None:
    mine = tmp_path / "mine.jsonl"
    write_passages(mine, [Passage(id="a", title="A", text="alpha text"), Passage(id="b", title="", text="b")])
    layout = DataLayout(tmp_path / "data")
    first = ensure_corpus(layout, mine)
    mine.unlink()  # later commands must not need the original file
    later = ensure_corpus(layout)
    assert [p.id for p in first] == [p.id for p in later] == ["a", "b"]
    assert later[0].text == "alpha text"


def test_the_default_corpus_is_built_when_the_data_dir_has_none(tmp_path: Path) -> None:
    passages = ensure_corpus(DataLayout(tmp_path / "data"))
    assert len(passages) > 1000 and (tmp_path / "data" / "corpus" / "passages.jsonl").is_file()


_PREPARE_INDEX = """
import logging, sys
from pathlib import Path
from specrag.paths import DataLayout
from specrag.retrieval.corpus import load_passages
from specrag.retrieval.index_store import IndexConfig
from specrag.service.run.assets import ensure_index

logging.basicConfig(level=logging.DEBUG, format="%(message)s")
layout = DataLayout(Path(sys.argv[1]))
config = IndexConfig(embedder="tfidf-svd", lexical=False, embedding_dim=16)
ensure_index(layout, load_passages(Path(sys.argv[2])), config)
"""


def test_two_prepares_at_once_build_the_index_once(tmp_path: Path) -> None:
    """the second waits for the first's lock, then finds the index built and loads it."""
    import os
    import subprocess
    import sys

    corpus = tmp_path / "corpus.jsonl"
    write_passages(
        corpus,
        [Passage(id=f"p{i}", title=f"T{i}", text=f"passage {i} about topic {i % 7}") for i in range(80)],
    )
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _PREPARE_INDEX, str(tmp_path / "data"), str(corpus)],
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
        )
        for _ in range(2)
    ]
    logs = [run.communicate(timeout=120)[1] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], logs
    assert sum("built the vector index" in log for log in logs) == 1, logs
    assert sum("loaded the vector index" in log for log in logs) == 1, logs
