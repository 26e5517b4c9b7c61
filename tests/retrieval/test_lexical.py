from __future__ import annotations

import json
from pathlib import Path

import pytest

from specrag.errors import ArtifactError, InvalidInputError
from specrag.retrieval.corpus import Passage
from specrag.retrieval.lexical.bm25 import LexicalIndex

WORDS = ("sockets", "threads", "queues", "heaps", "regexes", "dates", "bytes", "paths", "shells", "pickles")
TEXTS = [
    "The dictionary maps hashable keys to values.",
    "An event loop runs asynchronous tasks and callbacks.",
    "Paths name files and directories on the file system.",
    "Lists are mutable sequences; tuples are immutable.",
]


def test_stemmed_terms_find_the_passage() -> None:
    index = LexicalIndex.build(TEXTS)
    rows, scores = index.search("Which dictionaries map keys?", 3)
    assert rows[0] == 0 and scores[0] > 0
    assert index.terms("running the loops") == ["run", "loop"]  # stemmed, stop words gone


def test_only_matching_passages_are_returned_best_first() -> None:
    index = LexicalIndex.build(TEXTS)
    rows, scores = index.search("file directories", 10)
    assert list(rows) == [2]
    assert list(index.search("zebra quartz", 5)[0]) == []
    assert list(index.search("", 5)[0]) == []
    assert list(scores) == sorted(scores, reverse=True)
    with pytest.raises(InvalidInputError):
        index.search("file", 0)


def test_depth_keeps_the_best(passages: list[Passage]) -> None:
    index = LexicalIndex.build([p.text for p in passages])
    everything, all_scores = index.search("asyncio event loop tasks", len(passages))
    top, top_scores = index.search("asyncio event loop tasks", 5)
    assert list(top) == list(everything[:5])
    assert list(top_scores) == list(all_scores[:5])


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    index = LexicalIndex.build(TEXTS)
    entry = index.save(tmp_path)
    assert all((tmp_path / name).is_file() for name in entry["files"])
    loaded = LexicalIndex.load(tmp_path, entry)
    for query in ("keys", "event loop", "immutable tuples"):
        assert list(loaded.search(query, 4)[0]) == list(index.search(query, 4)[0])


def test_other_tokenisation_or_count_is_an_artifact_error(tmp_path: Path) -> None:
    entry = LexicalIndex.build(TEXTS).save(tmp_path)
    with pytest.raises(ArtifactError, match="rebuild"):
        LexicalIndex.load(tmp_path, {**entry, "analyzer": {**entry["analyzer"], "stemmer": "french"}})
    with pytest.raises(ArtifactError, match="manifest says"):
        LexicalIndex.load(tmp_path, {**entry, "num_passages": 5})
    (tmp_path / "lexical" / "params.index.json").write_text(json.dumps({"k1": "x"}), encoding="utf-8")
    with pytest.raises(ArtifactError, match="lexical"):
        LexicalIndex.load(tmp_path, entry)


def test_an_identifier_outweighs_the_question_words_around_it() -> None:
    # The first passage holds the question's ordinary words, only the second names the function;
    # the others make those ordinary words common and the name rare, as in a real corpus.
    texts = [
        "A module defines functions.",
        "zipfile.ZipFile.extractall: Extract all members from the archive.",
        "The json module defines functions to encode and decode data.",
        "A module is a file of definitions; a function defined in it is an attribute of the module.",
        "The os module defines functions for the operating system.",
        *(f"Passage {word} talks about {word} and nothing else." for word in WORDS),
    ]
    index = LexicalIndex.build(texts)
    question = "Which module defines the function `extractall`?"
    assert index.search(question, 2)[0][0] == 0  # every term counted once: the ordinary words win
    assert index.search(question, 2, identifier_weight=3)[0][0] == 1
    assert index.query_terms(question, 3).count("extractal") == 3
    with pytest.raises(InvalidInputError):
        index.query_terms(question, 0)
