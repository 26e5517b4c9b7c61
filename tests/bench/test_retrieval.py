"""bench.retrieval: the recall it reports, and its command line's last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.retrieval.__main__ import Query, belongs, hits_at, paired, quick_subset, scores
from bench.retrieval.sets import man_sections, roff_to_text
from specrag.retrieval.corpus import Passage

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
    assert result["query_ms_p50"] == 2.0 and 2.9 < result["query_ms_p99"] <= 3.0
    low, high = result["recall_at_10_ci"]
    assert 0 <= low <= result["recall_at_10"] <= high <= 1 and low < high


def test_paired_differences_are_per_query() -> None:
    queries = [Query(f"q{n}", f"d{n}") for n in range(4)]
    default = hits_at(queries, [["d0"], ["x"], ["x"], ["d3"]])
    other = hits_at(queries, [["d0"], ["d1"], ["d2"], ["d3"]])
    result = paired(default, other)
    assert result["recall_at_1_diff"] == 0.5
    assert 0 <= result["recall_at_1_diff_ci"][0] <= 0.5 <= result["recall_at_1_diff_ci"][1] <= 1
    assert paired(default, default)["recall_at_5_diff_ci"] == [0.0, 0.0]


def test_quick_keeps_every_answer_of_the_queries_it_keeps() -> None:
    passages = [Passage(f"d{n}#{part}", "", "text") for n in range(700) for part in range(2)]
    queries = [Query(f"q{n}", f"d{699 - n}") for n in range(300)]
    kept_passages, kept_queries = quick_subset(passages, queries)
    assert len(kept_queries) == 100
    assert {f"d{699 - n}#1" for n in range(100)} <= {passage.id for passage in kept_passages}
    assert len(kept_passages) == 500 + 200


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
    written = json.loads((ROOT / "bench" / "out" / "test-retrieval.json").read_text(encoding="utf-8"))
    assert written["table"][0]["method"].startswith("hybrid: MiniLM")
    assert [(row["method"], row["channel"]) for row in written["paired"]] == [
        ("WordLlama-IDF (fast)", "hybrid"),
        ("WordLlama-IDF (fast)", "dense"),
    ]
    assert {"embed_ms_p50", "embed_ms_p99", "query_ms_p99", "recall_at_5_ci"} <= set(written["table"][1])
