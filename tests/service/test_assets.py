"""The data directory remembers a user's corpus (its model's tokenizer was trained on it)."""

from __future__ import annotations

from pathlib import Path

from specrag.paths import DataLayout
from specrag.retrieval.corpus import Passage, write_passages
from specrag.service.assets import ensure_corpus


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
