"""Query workloads for the end-to-end experiments: real questions from the corpus, timed arrivals.

The workloads are :mod:`bench.traces`' document-ID traces over the corpus' passages, so the
ordering benchmark and this one share one definition of ``zipf``, ``bursty`` and ``multiturn``.
Each request becomes a query: a window of words from its top-ranked passage, so retrieval is real
(the passage and its neighbours come back). Zipf and multi-turn document ids are popularity ranks,
spread over the corpus by a seeded permutation; bursty ids are corpus positions, so a topic is a
run of consecutive passages (the corpus keeps a source document's passages together). Arrivals
follow a Poisson or gamma process; conversations keep their turns. Traces are JSONL so two runs
(or two configurations) replay exactly the same work.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.traces import document_trace, read_trace_lines
from specrag.atomic import atomic_write_text
from specrag.errors import InvalidInputError
from specrag.retrieval.corpus import Passage

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


def arrivals(n: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival offsets: Poisson when ``cv`` is 1, gamma inter-arrivals (burstier when cv > 1)."""
    if rate <= 0 or cv <= 0:
        raise InvalidInputError("rate and cv must be positive")
    shape = 1.0 / cv**2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def generate(
    passages: Sequence[Passage], workload: str, n: int, rate: float, *, cv: float = 1.0, seed: int = 0
) -> list[TraceQuery]:
    """A trace of ``n`` queries of one of :data:`bench.traces.WORKLOADS`."""
    requests = document_trace(workload, n, corpus=len(passages), seed=seed)
    rng = np.random.default_rng(seed)
    rows = np.arange(len(passages)) if workload == "bursty" else rng.permutation(len(passages))
    turns: Counter[str] = Counter()
    queries = []
    for request, t in zip(requests, arrivals(n, rate, cv, rng), strict=True):
        passage = passages[int(rows[int(request.docs[0])])]
        turn = 0
        if request.conv is not None:
            turn = turns[request.conv]
            turns[request.conv] += 1
        queries.append(TraceQuery(float(t), _query_from(passage, rng), request.conv, turn))
    return queries


def save_trace(path: Path, trace: Sequence[TraceQuery]) -> None:
    atomic_write_text(path, "".join(json.dumps(asdict(q)) + "\n" for q in trace))


def load_trace(path: Path) -> list[TraceQuery]:
    """Read a JSONL trace, naming the line of the first malformed record."""
    trace = []
    for number, record in read_trace_lines(path):
        try:
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
