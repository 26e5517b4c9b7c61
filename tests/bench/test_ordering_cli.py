"""The ordering benchmark's trace contract, run as the user runs it."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.traces import read_trace

ROOT = Path(__file__).resolve().parents[2]
TRACE: list[dict[str, Any]] = [
    {"docs": [3, 1, 2], "rid": "a"},
    {"docs": [2, 1, 5]},
    {"docs": ["x", 1, 3], "rid": 7, "conv": "c"},
    {"docs": [1, 2, 3], "rid": "d"},
]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.ordering", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    return path


@pytest.mark.parametrize("policy", ["retrieval", "exact", "batch", "window", "myopic-oracle"])
def test_emit_writes_every_request_once_with_its_documents_permuted(
    trace: Path, tmp_path: Path, policy: str
) -> None:
    out = tmp_path / "out.jsonl"
    result = run("--trace", str(trace), "--policy", policy, "--emit", str(out))
    assert result.returncode == 0, result.stderr
    emitted = read_trace(out)
    expected_rids = ["a", 1, 7, "d"]  # a missing rid is the line's index
    assert sorted(map(str, (e.rid for e in emitted))) == sorted(map(str, expected_rids))
    by_rid = {str(rid): r["docs"] for rid, r in zip(expected_rids, TRACE, strict=True)}
    for e in emitted:
        assert sorted(map(str, e.docs)) == sorted(map(str, by_rid[str(e.rid)]))
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["policy"] == policy and summary["requests"] == 4
    for cache in ("unlimited", "lru10"):
        assert 0.0 <= summary["prefix_reuse"][cache]["token_reuse"] <= 1.0
    assert summary["emitted_from"] == "lru10"
    assert set(summary["independent"]) == {"unlimited", "lru"}
    if policy == "retrieval":
        assert [list(e.docs) for e in emitted] == [r["docs"] for r in TRACE]


def test_exact_reorders_the_last_request_onto_the_cached_path(trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    assert run("--trace", str(trace), "--policy", "exact", "--emit", str(out)).returncode == 0
    assert read_trace(out)[-1].docs[:2] == (3, 1)  # request "a" served 3, 1, 2 first


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (None, ["--policy", "exact"], "cannot read trace"),
        ('{"docs": [1]}\n', ["--policy", "window", "--window", "soon"], "--window"),
        ('{"docs": [1], "arrival_s": -1}\n', ["--policy", "window"], "arrival_s"),
        ('{"docs": [1]}\n{"docs": [1, \n', ["--policy", "exact"], "line 2"),
        ('{"docs": [1, 1]}\n', ["--policy", "exact"], "line 1"),
        ('{"docs": [1]}\n', ["--policy", "fastest"], "unknown policy"),
    ],
)
def test_bad_input_fails_clearly(tmp_path: Path, content: str | None, args: list[str], message: str) -> None:
    path = tmp_path / "trace.jsonl"
    if content is not None:
        path.write_text(content)
    result = run("--trace", str(path), *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def emitted_rids(path: Path) -> list[object]:
    return [request.rid for request in read_trace(path)]


def test_window_replays_the_traces_arrival_times_and_emits_in_execution_order(tmp_path: Path) -> None:
    # all but the first arrive while the first is served: the window admits the request sharing
    # the most with what is cached, not the next in line
    records = [
        {"rid": "first", "docs": [1, 2, 3], "arrival_s": 0.0},
        {"rid": "stranger", "docs": [7, 8, 9], "arrival_s": 0.001},
        {"rid": "sibling", "docs": [3, 2, 1], "arrival_s": 0.002},
    ]
    path = tmp_path / "timed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out.jsonl"
    args = ("--trace", str(path), "--policy", "window", "--emit", str(out), "--emit-cache", "unlimited")
    result = run(*args)
    assert result.returncode == 0, result.stderr
    assert emitted_rids(out) == [
        "first",
        "sibling",
        "stranger",
    ]
    assert read_trace(out)[1].docs == (1, 2, 3)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["emitted_from"] == "unlimited" and summary["independent"]["unlimited"] == 3 / 9
    fifo = run("--trace", str(path), "--policy", "window", "--window", "1", "--emit", str(out))
    assert fifo.returncode == 0, fifo.stderr
    assert emitted_rids(out) == [
        "first",
        "stranger",
        "sibling",
    ]
