"""The arrival-timed replay and the topic-cluster traces behind ``bench.ordering --policy window``."""

import dataclasses
import itertools
from pathlib import Path

import pytest

from bench.ordering import topic_traces
from bench.ordering.replay import Window
from bench.ordering.runs import simulate_replay
from bench.ordering.simulation import RunResult
from bench.ordering.topic_traces import SHAPES, TopicShape, topic_cluster_trace
from bench.traces import TraceRequest, read_trace
from specrag.errors import InvalidInputError


def busy_trace(n: int = 120, seed: int = 3) -> list[TraceRequest]:
    """A trace whose requests arrive faster than one slot serves them, so that queues form."""
    return topic_cluster_trace(n, dataclasses.replace(SHAPES["contextpilot"], rate_per_s=6.0), seed=seed)


def executed(result: RunResult) -> list[int]:
    return [int(rid) for rid, _ in result.order]


def test_a_window_of_one_request_is_first_come_first_served() -> None:
    trace = busy_trace()
    result = simulate_replay(trace, None, "window", window=Window(requests=1))
    assert executed(result) == list(range(len(trace)))
    assert result.replay is not None and result.replay["overtaken_max"] == 0


def test_a_wider_window_reorders_within_its_bounds() -> None:
    trace = busy_trace()
    arrivals = {r.rid: r.arrival_s for r in trace}
    result = simulate_replay(trace, None, "window", window=Window(requests=64, seconds=0.5))
    order = executed(result)
    assert sorted(order) == list(range(len(trace))) and order != sorted(order)
    for position, rid in enumerate(order):  # never overtaken by a request 0.5 s younger or more
        for earlier in order[:position]:
            if earlier > rid:
                assert arrivals[earlier] - arrivals[rid] <= 0.5 + 1e-9  # type: ignore[operator]
    for (_, docs), request in zip(sorted(result.order, key=lambda o: int(o[0])), trace, strict=True):
        assert sorted(docs) == sorted(request.docs)


def test_window_parsing() -> None:
    assert Window.parse("8") == Window(requests=8)
    assert Window.parse("250ms") == Window(requests=256, seconds=0.25)
    for bad in ("0", "-5ms", "fast", "1.5"):
        with pytest.raises(InvalidInputError):
            Window.parse(bad)


def test_topic_traces_are_seeded_and_cluster_by_subject() -> None:
    shape = TopicShape(topics=10, docs_per_topic=12, off_topic=0.0, locality=0.9)
    trace = topic_cluster_trace(200, shape, seed=5)
    assert trace == topic_cluster_trace(200, shape, seed=5) != topic_cluster_trace(200, shape, seed=6)
    subjects = [{int(d) // 12 for d in r.docs} for r in trace]
    assert all(len(s) == 1 and len(r.docs) == 10 for s, r in zip(subjects, trace, strict=True))
    repeats = sum(a == b for a, b in itertools.pairwise(subjects))
    assert repeats > 150  # locality 0.9: most questions stay on the previous one's subject
    times = [r.arrival_s for r in trace]
    assert times == sorted(times)  # type: ignore[type-var]
    with pytest.raises(InvalidInputError):
        topic_cluster_trace(5, TopicShape(docs_per_topic=5))


def test_trace_generator_cli_writes_a_readable_trace_and_rejects_bad_input(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    assert topic_traces.main(["--shape", "runs", "--seed", "2", "-n", "30", "--out", str(out)]) == 0
    assert read_trace(out) == topic_cluster_trace(30, SHAPES["runs"], seed=2)
    assert topic_traces.main(["-n", "-1", "--out", str(out)]) == 2
