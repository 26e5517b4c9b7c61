"""The independent scorer of emitted orderings (bench.ordering.score), checked by hand and by
properties that any prefix-reuse score must have."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.ordering.score import lru_capacity, reused_slots, score

ROOT = Path(__file__).resolve().parents[2]


def test_a_slot_counts_only_when_its_whole_prefix_was_served_before() -> None:
    orders = [(1, 2, 3), (1, 2, 4), (2, 1), (1, 2, 4, 5)]
    # request 2 reuses (1), (1, 2); request 3 nothing ((2) was never a prefix); request 4 reuses
    # (1), (1, 2), (1, 2, 4)
    assert reused_slots(orders, None) == 5
    assert score(orders)["unlimited"] == 5 / 12


def test_the_lru_keeps_a_requests_first_prefixes_longest() -> None:
    orders = [(1, 2, 3), (1, 2, 4), (5,), (1, 9)]
    # capacity 2: after request 1 it holds (1), (1, 2); request 2 reuses both, then holds the
    # same two; request 3 evicts (1, 2); request 4 still finds (1)
    assert reused_slots(orders, 2) == 3
    assert reused_slots(orders, 1) == 1  # only (1) survives a request, and (5) evicts it
    assert lru_capacity(orders) == 1  # 10 % of 9 slots


orders_strategy = st.lists(
    st.lists(st.integers(0, 6), min_size=1, max_size=5, unique=True).map(tuple), max_size=30
)


@settings(max_examples=80, deadline=None)
@given(orders_strategy, st.integers(1, 40))
def test_a_bounded_cache_never_reuses_more_and_a_large_one_equals_the_unlimited(
    orders: list[tuple[int, ...]], capacity: int
) -> None:
    unlimited = reused_slots(orders, None)
    assert reused_slots(orders, capacity) <= unlimited
    assert reused_slots(orders, capacity) <= reused_slots(orders, capacity + 1)
    prefixes = {order[: i + 1] for order in orders for i in range(len(order))}
    assert reused_slots(orders, max(1, len(prefixes))) == unlimited
    relabelled = [tuple(f"doc-{d}" for d in order) for order in orders]
    assert reused_slots(relabelled, capacity) == reused_slots(orders, capacity)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.ordering.score", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def write(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_cli_scores_an_emitted_file_checked_against_its_trace(tmp_path: Path) -> None:
    trace = write(tmp_path / "trace.jsonl", [{"rid": "a", "docs": [1, 2]}, {"docs": [2, 1, 3]}])
    emitted = write(tmp_path / "out.jsonl", [{"rid": "a", "docs": [2, 1]}, {"rid": 1, "docs": [2, 1, 3]}])
    result = run(str(emitted), "--trace", str(trace))
    assert result.returncode == 0, result.stderr
    # the LRU holds one prefix (10 % of 5 slots, at least one): (2) from the first request
    assert json.loads(result.stdout) == {"requests": 2, "slots": 5, "unlimited": 0.4, "lru": 0.2}


@pytest.mark.parametrize(
    ("emitted", "message"),
    [
        ([{"rid": "a", "docs": [2, 1]}], "missing"),
        ([{"rid": "a", "docs": [2, 1]}, {"rid": 1, "docs": [2, 1, 4]}], "not a permutation"),
        ([{"rid": "a", "docs": [2, 1]}, {"rid": "a", "docs": [2, 1]}], "twice"),
    ],
)
def test_cli_rejects_an_emitted_file_that_does_not_match_its_trace(
    tmp_path: Path, emitted: list[dict[str, object]], message: str
) -> None:
    trace = write(tmp_path / "trace.jsonl", [{"rid": "a", "docs": [1, 2]}, {"docs": [2, 1, 3]}])
    result = run(str(write(tmp_path / "out.jsonl", emitted)), "--trace", str(trace))
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
