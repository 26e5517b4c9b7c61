from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from specrag.errors import InvalidInputError
from specrag.retrieval import commands
from specrag.retrieval.index_store import load_index

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "sigma",
    "omega",
    "rho",
]


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir")
    commands.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    result: int = args.handler(args)
    return result


def test_index_build_writes_a_loadable_index(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(
            f'{{"id": "d{i}", "text": "{WORDS[i % 7]} and {WORDS[i % 11]} with {WORDS[i % 13]}"}}\n'
            for i in range(60)
        ),
        encoding="utf-8",
    )
    build = ["--data-dir", str(tmp_path), "index", "build", "--corpus", str(corpus)]
    assert run([*build, "--embedder", "tfidf-svd", "--dim", "8", "--no-lexical"]) == 0
    index = load_index(tmp_path / "index")
    assert index.passage_ids == [f"d{i}" for i in range(60)]
    assert (index.dim, index.hybrid) == (8, False)
    assert run(build) == 0
    default = load_index(tmp_path / "index")
    assert (default.dim, default.hybrid) == (256, True)
    assert getattr(default.embedder, "kind", None) == "wordllama-idf"


def test_index_build_shards_writes_one_directory_a_shard(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(f'{{"id": "d{i}", "text": "{WORDS[i % 7]} and {WORDS[i % 11]}"}}\n' for i in range(90)),
        encoding="utf-8",
    )
    build = [
        "--data-dir",
        str(tmp_path),
        "index",
        "build",
        "--corpus",
        str(corpus),
        "--embedder",
        "tfidf-svd",
    ]
    assert run([*build, "--dim", "8", "--shards", "3"]) == 0
    index = load_index(tmp_path / "index")
    assert index.searcher.settings["shards"] == 3
    assert sorted(path.name for path in (tmp_path / "index").glob("shard-*")) == [
        "shard-000",
        "shard-001",
        "shard-002",
    ]
    with pytest.raises(InvalidInputError, match="shard count must be at least 1"):
        run([*build, "--shards", "0"])
    with pytest.raises(InvalidInputError, match="at least as many rows"):
        run([*build, "--shards", "91"])


def test_a_brought_embedder_needs_its_model_or_server(tmp_path: Path) -> None:
    build = ["--data-dir", str(tmp_path), "index", "build"]
    with pytest.raises(InvalidInputError, match="--embedder-url"):
        run([*build, "--embedder", "openai", "--embedder-model", "m"])
    with pytest.raises(InvalidInputError, match="--embedder-model DIR"):
        run([*build, "--embedder", "sentence-transformers"])
    assert not (tmp_path / "corpus").exists()  # rejected before any work
