"""bench.retrieval: the recall it reports, and its command line's last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.retrieval.__main__ import Query, belongs, scores
from bench.retrieval.sets import man_sections, roff_to_text

ROOT = Path(__file__).resolve().parents[2]


def test_a_passage_belongs_to_its_document_only() -> None:
    assert belongs("man2/open#3", "man2/open") and belongs("doc", "doc")
    assert not belongs("man2/openat#0", "man2/open") and not belongs("man2/open", "man2/open#3")


def test_recall_counts_a_query_once_at_each_k() -> None:
    queries = [Query("q1", "a"), Query("q2", "b"), Query("q3", "c")]
    rankings = [["a#0", "a#1", "x"], ["x", "y", "z", "w", "v", "b#2"], []]
    result = scores(queries, rankings, [0.001, 0.002, 0.003])
    assert (result["recall_at_1"], result["recall_at_5"], result["recall_at_10"]) == (
        round(1 / 3, 4),
        round(1 / 3, 4),
        round(2 / 3, 4),
    )
    assert result["query_ms_p50"] == 2.0


def test_roff_pages_become_sections_of_text() -> None:
    page = "\n".join(
        [
            '.\\" a comment',
            ".TH OPEN 2",
            ".SH NAME",
            "open, creat \\- open and possibly create a \\fIfile\\fP",
            ".SH DESCRIPTION",
            ".BR open ()",
            "returns a file descriptor\\(emthe lowest one.",
        ]
    )
    sections = man_sections(page)
    assert sections == {
        "NAME": "open, creat - open and possibly create a file",
        "DESCRIPTION": "open() returns a file descriptor-the lowest one.",
    }
    assert man_sections(".so man2/open.2") is None
    assert roff_to_text("\\fBbold\\fR and \\e") == "bold and \\"


@pytest.mark.timeout(300)
def test_the_last_line_is_the_default_configurations_json(tmp_path: Path) -> None:
    words = ["socket", "thread", "signal", "pipe", "mutex", "timer", "file", "clock", "queue", "fork"]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps(
                {"id": f"d{i}", "title": f"doc {i}", "text": f"{words[i % 10]} {words[i // 10 % 10]} notes"}
            )
            + "\n"
            for i in range(80)
        ),
        encoding="utf-8",
    )
    queries = tmp_path / "queries.jsonl"
    queries.write_text(
        json.dumps({"query": "socket thread notes", "answer_id": "d10"}) + "\n", encoding="utf-8"
    )
    files = ["--corpus", str(corpus), "--queries", str(queries), "--data-dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "bench.retrieval", *files, "--name", "test-retrieval"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(last) == {
        "recall_at_1",
        "recall_at_5",
        "recall_at_10",
        "dense_only",
        "index_build_s",
        "docs_per_s",
        "query_ms_p50",
    }
    assert last["recall_at_10"] == 1.0  # the only document with both words, found by BM25
    assert 0 <= last["dense_only"]["recall_at_5"] <= 1
    assert (tmp_path / "bench-retrieval" / "index-0" / "manifest.json").is_file()
