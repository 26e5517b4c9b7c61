"""Query workloads for the end-to-end experiments: real questions from the corpus, timed arrivals.

Queries are windows of words taken from corpus passages, so retrieval is real (the passage and
its neighbours come back). Which passage a query comes from follows the popularity pattern of the
workload; when it arrives follows a Poisson or gamma process. Traces are JSONL so two runs (or
two configurations) replay exactly the same work.

- ``zipf``: passages drawn by Zipf popularity (a few passages draw most retrievals, RAGCache §3).
- ``bursty``: bursts of queries on one topic (a stdlib module or reference topic), a fraction
  ``overlap`` of each burst from the topic, the rest Zipf background (RAGCache++ §4.1).
- ``multiturn``: conversations of several turns on one topic, each turn a follow-up question.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specrag.atomic import atomic_write_text
from specrag.errors import InvalidInputError
from specrag.retrieval.corpus import Passage

WORKLOADS = ("zipf", "bursty", "multiturn")
QUERY_WORDS = 14


@dataclass(frozen=True)
class TraceQuery:
    """One query of a trace: arrival offset in seconds, text, and its conversation if any."""

    t: float
    query: str
    session: str | None = None
    turn: int = 0


def _query_from(passage: Passage, rng: np.random.Generator) -> str:
    words = passage.text.split()
    start = int(rng.integers(0, max(1, len(words) - QUERY_WORDS)))
    return " ".join(words[start : start + QUERY_WORDS])


def _topics(passages: Sequence[Passage]) -> list[list[int]]:
    """Passages grouped by source document (the id before '#'), largest groups first."""
    groups: dict[str, list[int]] = defaultdict(list)
    for row, passage in enumerate(passages):
        groups[passage.id.split("#")[0]].append(row)
    return sorted(groups.values(), key=len, reverse=True)


def arrivals(n: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival offsets: Poisson when ``cv`` is 1, gamma inter-arrivals (burstier when cv > 1)."""
    if rate <= 0 or cv <= 0:
        raise InvalidInputError("rate and cv must be positive")
    shape = 1.0 / cv**2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def generate(
    passages: Sequence[Passage],
    workload: str,
    n: int,
    rate: float,
    *,
    cv: float = 1.0,
    zipf_exponent: float = 1.1,
    burst: int = 10,
    overlap: float = 0.6,
    turns: int = 3,
    seed: int = 0,
) -> list[TraceQuery]:
    """A trace of ``n`` queries of the given workload kind."""
    if workload not in WORKLOADS:
        raise InvalidInputError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    if n < 1:
        raise InvalidInputError("a trace needs at least one query")
    rng = np.random.default_rng(seed)
    popularity = rng.permutation(len(passages))
    weights = 1.0 / np.arange(1, len(passages) + 1) ** zipf_exponent
    weights /= weights.sum()

    def zipf_row() -> int:
        return int(popularity[rng.choice(len(passages), p=weights)])

    topics = [group for group in _topics(passages) if len(group) >= 3]
    times = arrivals(n, rate, cv, rng)
    queries: list[TraceQuery] = []
    if workload == "zipf":
        queries = [TraceQuery(float(t), _query_from(passages[zipf_row()], rng)) for t in times]
    elif workload == "bursty":
        topic: list[int] = []
        for i, t in enumerate(times):
            if i % burst == 0:
                topic = topics[int(rng.integers(len(topics)))]
            row = int(rng.choice(topic)) if rng.random() < overlap else zipf_row()
            queries.append(TraceQuery(float(t), _query_from(passages[row], rng)))
    else:
        session_topic: list[int] = []
        for i, t in enumerate(times):
            turn = i % turns
            if turn == 0:
                session_topic = topics[int(rng.integers(len(topics)))]
            row = int(rng.choice(session_topic))
            queries.append(TraceQuery(float(t), _query_from(passages[row], rng), f"s{i // turns}", turn))
    return queries


def save_trace(path: Path, trace: Sequence[TraceQuery]) -> None:
    atomic_write_text(path, "".join(json.dumps(asdict(q)) + "\n" for q in trace))


def load_trace(path: Path) -> list[TraceQuery]:
    """Read a JSONL trace, naming the line of the first malformed record."""
    trace = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            trace.append(
                TraceQuery(
                    float(record["t"]),
                    str(record["query"]),
                    record.get("session"),
                    int(record.get("turn", 0)),
                )
            )
        except (ValueError, KeyError, TypeError) as error:
            raise InvalidInputError(f"{path}:{number}: not a trace query ({error})") from error
    if not trace:
        raise InvalidInputError(f"{path}: empty trace")
    return trace
