"""Document-ID request traces, the one definition of the benchmarks' workloads.

A trace is what the retriever hands the cache layer: one request a line, its documents in
retrieval rank. Three generators cover the sharing patterns that matter for prefix reuse:

- ``zipf``: independent requests over a corpus with Zipf document popularity (a hot head).
- ``bursty``: topic bursts with a controlled overlap between consecutive requests, as in the
  RAGCache++ evaluation (regions of documents, bursts of queries from one region).
- ``multiturn``: interleaved conversations whose turns re-retrieve part of earlier turns'
  documents (MT-RAG-like sessions), with conversation ids for de-duplication.

``bench.ordering`` replays these traces as they are; ``bench.e2e.workload`` turns each request
into a question about its top-ranked document, so both benchmarks run the same workloads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specrag.atomic import atomic_write_text
from specrag.cache import DocId
from specrag.errors import InvalidInputError


@dataclass(frozen=True, slots=True)
class TraceRequest:
    rid: int | str
    docs: tuple[DocId, ...]
    conv: str | None = None
    arrival_s: float | None = None  # seconds from the trace's start, for arrival-timed replays


def _zipf_weights(corpus: int, exponent: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, corpus + 1) ** exponent
    return weights / weights.sum()


def zipf_trace(
    n: int, *, k: int = 10, corpus: int = 2000, exponent: float = 1.0, seed: int = 0
) -> list[TraceRequest]:
    """Each request draws ``k`` distinct documents by Zipf popularity; draw order is the rank."""
    rng = np.random.default_rng(seed)
    weights = _zipf_weights(corpus, exponent)
    return [
        TraceRequest(i, tuple(int(d) for d in rng.choice(corpus, size=k, replace=False, p=weights)))
        for i in range(n)
    ]


def bursty_trace(
    n: int,
    *,
    k: int = 10,
    topics: int = 50,
    docs_per_topic: int = 20,
    burst: int = 10,
    overlap: float = 0.6,
    seed: int = 0,
) -> list[TraceRequest]:
    """Bursts of ``burst`` requests on one topic; each keeps ``overlap`` of the previous one's docs."""
    if not 0.0 <= overlap <= 1.0 or k > docs_per_topic:
        raise InvalidInputError("overlap must be in [0, 1] and k at most docs_per_topic")
    rng = np.random.default_rng(seed)
    keep = round(overlap * k)
    requests: list[TraceRequest] = []
    previous: list[int] = []
    for i in range(n):
        if i % burst == 0:
            pool = int(rng.integers(topics)) * docs_per_topic + np.arange(docs_per_topic)
            previous = [int(d) for d in rng.choice(pool, size=k, replace=False)]
        else:
            kept = [int(d) for d in rng.choice(previous, size=keep, replace=False)]
            fresh = rng.choice(np.setdiff1d(pool, kept), size=k - keep, replace=False)
            previous = kept + [int(d) for d in fresh]
        rng.shuffle(previous)
        requests.append(TraceRequest(i, tuple(previous)))
    return requests


def multiturn_trace(
    n: int,
    *,
    k: int = 10,
    corpus: int = 2000,
    turns: tuple[int, int] = (3, 8),
    overlap: float = 0.5,
    active: int = 8,
    seed: int = 0,
) -> list[TraceRequest]:
    """``active`` interleaved conversations; each turn keeps ``overlap`` of its previous turn's docs."""
    rng = np.random.default_rng(seed)
    weights = _zipf_weights(corpus, 1.0)
    keep = round(overlap * k)
    sessions: list[tuple[str, int, list[int]]] = []
    started = 0
    requests: list[TraceRequest] = []
    while len(requests) < n:
        while len(sessions) < active:
            sessions.append((f"c{started}", int(rng.integers(turns[0], turns[1] + 1)), []))
            started += 1
        index = int(rng.integers(len(sessions)))
        conv, left, previous = sessions[index]
        kept = [int(d) for d in rng.choice(previous, size=keep, replace=False)] if previous else []
        candidates = rng.choice(corpus, size=3 * k, replace=False, p=weights)
        fresh = [int(d) for d in candidates if d not in kept][: k - len(kept)]
        docs = kept + fresh
        rng.shuffle(docs)
        requests.append(TraceRequest(len(requests), tuple(docs), conv))
        if left > 1:
            sessions[index] = (conv, left - 1, docs)
        else:
            sessions.pop(index)
    return requests


WORKLOADS = ("zipf", "bursty", "multiturn")
# multiturn draws 3 × k = 30 distinct candidates per request; bursty needs one topic of 20.
_MIN_CORPUS = 30
_DOCS_PER_TOPIC = 20


def document_trace(workload: str, n: int, *, corpus: int, seed: int = 0) -> list[TraceRequest]:
    """``n`` requests of one of :data:`WORKLOADS` over documents ``0 .. corpus - 1``.

    Each generator keeps its other defaults. Zipf and multi-turn ids are popularity ranks (0 is
    the most popular); bursty ids are positions, and a topic is a run of consecutive ids.
    """
    if workload not in WORKLOADS:
        raise InvalidInputError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    if n < 1:
        raise InvalidInputError("a trace needs at least one request")
    if corpus < _MIN_CORPUS:
        raise InvalidInputError(f"a trace needs a corpus of at least {_MIN_CORPUS} documents, got {corpus}")
    if workload == "zipf":
        return zipf_trace(n, corpus=corpus, seed=seed)
    if workload == "bursty":
        topics = corpus // _DOCS_PER_TOPIC
        return bursty_trace(n, topics=topics, docs_per_topic=_DOCS_PER_TOPIC, seed=seed)
    return multiturn_trace(n, corpus=corpus, seed=seed)


def read_trace_lines(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """The JSON object of every line of a JSONL trace file, with its line number.

    The one reader of JSONL files in bench/ (document-ID traces, emitted orders, the end-to-end
    query traces, the retrieval benchmark's queries): blank lines are skipped, and a file that
    cannot be read or a line that is not a JSON object is an InvalidInputError naming the file
    and the line. What a record must hold is the caller's to check.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidInputError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{path} line {lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise InvalidInputError(f"{path} line {lineno}: expected a JSON object")
        records.append((lineno, record))
    return records


def _trace_request(record: dict[str, Any], lineno: int) -> TraceRequest:
    if not isinstance(record.get("docs"), list):
        raise InvalidInputError(f'line {lineno}: expected an object with a "docs" list')
    docs = record["docs"]
    if not all(isinstance(d, int | str) and not isinstance(d, bool) for d in docs):
        raise InvalidInputError(f"line {lineno}: document ids must be integers or strings")
    if len(set(docs)) != len(docs):
        raise InvalidInputError(f"line {lineno}: a document id appears twice")
    rid = record.get("rid", lineno - 1)
    conv = record.get("conv")
    if not isinstance(rid, int | str) or isinstance(rid, bool) or not (conv is None or isinstance(conv, str)):
        raise InvalidInputError(f'line {lineno}: "rid" must be an integer or string, "conv" a string')
    arrival = record.get("arrival_s")
    if arrival is not None and (
        not isinstance(arrival, int | float) or isinstance(arrival, bool) or arrival < 0
    ):
        raise InvalidInputError(f'line {lineno}: "arrival_s" must be a non-negative number of seconds')
    return TraceRequest(rid, tuple(docs), conv, None if arrival is None else float(arrival))


def read_trace(path: Path) -> list[TraceRequest]:
    """Parse a JSONL document-ID trace; errors name the line."""
    return [_trace_request(record, lineno) for lineno, record in read_trace_lines(path)]


def write_trace(path: Path, requests: Sequence[TraceRequest]) -> None:
    lines = []
    for r in requests:
        record: dict[str, object] = {"rid": r.rid, "docs": list(r.docs)}
        if r.conv is not None:
            record["conv"] = r.conv
        if r.arrival_s is not None:
            record["arrival_s"] = r.arrival_s
        lines.append(json.dumps(record))
    atomic_write_text(path, "".join(line + "\n" for line in lines))
