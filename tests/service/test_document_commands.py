"""``specrag documents`` offline on a data directory: changes logged, replayed by the next start."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from specrag.cli import main
from specrag.errors import InvalidInputError
from specrag.paths import DataLayout
from specrag.pipeline.store.document_writes import Written
from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.retrieval.corpus import Passage
from specrag.service.run.assets import Assets, ensure_assets


def copied_data_dir(assets: Assets, target: Path) -> Path:
    """The tiny assets' corpus, store and index in a data directory of the test's own."""
    root = assets.store.path.parent.parent
    for part in ("corpus", "index"):
        shutil.copytree(root / part, target / part)
    (target / "store").mkdir()
    shutil.copy2(assets.store.path, target / "store" / assets.store.path.name)
    return target


def test_add_get_and_delete_offline(
    tiny_assets: Assets, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = copied_data_dir(tiny_assets, tmp_path / "data")
    documents = tmp_path / "new.jsonl"
    documents.write_text(
        json.dumps({"id": "quokka", "title": "quokka module", "text": "The quokka module counts marsupials."})
        + "\n\n"
        + json.dumps({"id": tiny_assets.index.passage_ids[0], "text": "A second version."})
        + "\n"
    )
    common = ["--data-dir", str(data)]
    model = ["--model", str(tiny_model_dir)]
    assert main([*common, "documents", "add", str(documents), *model]) == 0
    written = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(one["id"], one["version"], one["created"]) for one in written] == [
        ("quokka", 1, True),
        (tiny_assets.index.passage_ids[0], 2, False),
    ]
    assert main([*common, "documents", "get", "quokka", *model]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == "The quokka module counts marsupials."

    assets = ensure_assets(DataLayout(data), tiny_model_dir)  # what the next serve loads
    assert assets.corpus is not None and assets.corpus.get("quokka").version == 1
    assert assets.store.row_of("quokka") == len(tiny_assets.index.passage_ids)
    assets.store.close()

    assert main([*common, "documents", "delete", "quokka", *model]) == 0
    capsys.readouterr()
    assert main([*common, "documents", "get", "quokka", *model]) == 2
    assert "unknown document id 'quokka'" in capsys.readouterr().err


def test_a_bad_documents_file_names_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    documents = tmp_path / "bad.jsonl"
    documents.write_text('{"id": "a", "text": "fine"}\n{"id": "b"}\n')
    assert main(["--data-dir", str(tmp_path), "documents", "add", str(documents)]) == 2
    assert "line 2" in capsys.readouterr().err


def test_an_offline_import_failing_part_way_prints_what_was_committed(
    tiny_assets: Assets,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Batches of 2 (each one transaction); the second fails: the first stays, and is reported."""
    monkeypatch.setattr("specrag.service.cli.document_commands.MAX_BATCH_DOCUMENTS", 2)
    put = LiveCorpus.put
    calls = []

    def failing_second(corpus: LiveCorpus, passages: Sequence[Passage]) -> list[Written]:
        calls.append(len(passages))
        if len(calls) == 2:
            raise InvalidInputError("the second batch fails")
        return put(corpus, passages)

    monkeypatch.setattr(LiveCorpus, "put", failing_second)
    data = copied_data_dir(tiny_assets, tmp_path / "data")
    documents = tmp_path / "five.jsonl"
    documents.write_text(
        "\n".join(json.dumps({"id": f"new{i}", "text": f"new text {i}"}) for i in range(5)) + "\n"
    )
    common = ["--data-dir", str(data)]
    model = ["--model", str(tiny_model_dir)]
    assert main([*common, "documents", "add", str(documents), *model]) == 2
    out, err = capsys.readouterr()
    assert [json.loads(line)["id"] for line in out.splitlines()] == ["new0", "new1"]
    assert "2 of 5 documents committed (printed above); batch 2 of 3" in err
    assert "line 3" in err and "the second batch fails" in err
    monkeypatch.setattr(LiveCorpus, "put", put)
    assert main([*common, "documents", "get", "new1", *model]) == 0
    assert main([*common, "documents", "get", "new2", *model]) == 2


def test_an_offline_document_longer_than_the_model_context_is_refused_naming_the_limit(
    tiny_assets: Assets, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = copied_data_dir(tiny_assets, tmp_path / "data")
    documents = tmp_path / "long.jsonl"
    text = " ".join(f"m{number} c" for number in range(9000))  # under the character limit
    documents.write_text(json.dumps({"id": "long", "text": text}) + "\n")
    common = ["--data-dir", str(data), "documents"]
    model = ["--model", str(tiny_model_dir)]
    assert main([*common, "add", str(documents), *model]) == 2
    assert re.search(r"'long' is \d+ tokens long; at most \d+ fit", capsys.readouterr().err)
    assert main([*common, "get", "long", *model]) == 2
