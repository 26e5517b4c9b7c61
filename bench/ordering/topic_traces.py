"""Topic-cluster document-ID traces with arrival times, shaped like ContextPilot's RAG workloads.

ContextPilot evaluates context reuse on question sets where many questions are about the same few
subjects (news events, books, code bases): their retrievals overlap heavily inside a subject and
barely across subjects, and every retriever ranks the shared documents differently. This
generator reproduces that shape so ordering policies can be tuned on many such traces (different
seeds and shapes) instead of one:

- ``topics`` subjects with Zipf popularity (``topic_skew``); questions interleave at random, so
  a subject's questions are spread over the whole trace, not bunched;
- each subject has a pool of ``docs_per_topic`` documents with Zipf relevance (``doc_skew``): a
  few core documents come back for most of its questions, the rest for some;
- a question retrieves ``k`` documents: from its subject's pool, except that each slot is, with
  probability ``off_topic``, a document from the whole corpus (retrieval noise);
- the rank of a question's documents is their draw order (a Plackett-Luce ranking by relevance),
  so two questions sharing documents almost never list them in the same order;
- with probability ``locality`` a question is on the same subject as the one before (users
  asking follow-ups, a subject in the news): subjects come in runs instead of fully interleaved;
- arrivals are a Poisson process of ``rate_per_s`` questions a second.

    python -m bench.ordering.topic_traces --shape contextpilot --seed 11 -n 500 --out T.jsonl
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.traces import TraceRequest, write_trace
from specrag.errors import InvalidInputError


@dataclass(frozen=True, slots=True)
class TopicShape:
    """The shape of a topic-cluster trace (see the module docstring for what each knob does)."""

    k: int = 10
    topics: int = 40
    docs_per_topic: int = 30
    topic_skew: float = 0.8
    doc_skew: float = 1.0
    off_topic: float = 0.1
    locality: float = 0.0
    rate_per_s: float = 1.0

    def check(self) -> None:
        if self.k < 1 or self.topics < 1 or self.docs_per_topic < self.k:
            raise InvalidInputError("need k >= 1, topics >= 1 and docs_per_topic >= k")
        if not (0.0 <= self.off_topic < 1.0 and 0.0 <= self.locality < 1.0):
            raise InvalidInputError("off_topic and locality must be in [0, 1)")
        if self.topic_skew < 0 or self.doc_skew < 0:
            raise InvalidInputError("the skews must be non-negative")
        if self.rate_per_s <= 0:
            raise InvalidInputError("the arrival rate must be positive")


SHAPES: dict[str, TopicShape] = {
    "contextpilot": TopicShape(),
    "few-topics": TopicShape(topics=12, docs_per_topic=40, doc_skew=0.8),
    "many-topics": TopicShape(topics=120, docs_per_topic=20, topic_skew=1.0),
    "flat": TopicShape(doc_skew=0.5, off_topic=0.2),
    "core-heavy": TopicShape(doc_skew=1.4, off_topic=0.05),
    "runs": TopicShape(locality=0.5),
    "long-runs": TopicShape(topics=60, locality=0.8, doc_skew=0.8),
}
"""Named shapes for tuning across more than one kind of trace; ``contextpilot`` is the default."""


def _zipf(n: int, exponent: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** exponent
    return weights / weights.sum()


def topic_cluster_trace(n: int, shape: TopicShape | None = None, *, seed: int = 0) -> list[TraceRequest]:
    """``n`` questions of the given shape, with arrival times; documents in retrieval rank."""
    shape = shape or TopicShape()
    shape.check()
    if n < 0:
        raise InvalidInputError("the number of requests cannot be negative")
    rng = np.random.default_rng(seed)
    corpus = shape.topics * shape.docs_per_topic
    topic_weights = _zipf(shape.topics, shape.topic_skew)
    doc_weights = _zipf(shape.docs_per_topic, shape.doc_skew)
    # each subject's core documents are scattered over its pool's ids, not its lowest ones
    pools = [t * shape.docs_per_topic + rng.permutation(shape.docs_per_topic) for t in range(shape.topics)]
    arrivals = np.cumsum(rng.exponential(1.0 / shape.rate_per_s, size=n))
    requests: list[TraceRequest] = []
    topic = int(rng.choice(shape.topics, p=topic_weights))
    for i in range(n):
        if i and rng.random() >= shape.locality:
            topic = int(rng.choice(shape.topics, p=topic_weights))
        pool = pools[topic]
        on_topic = shape.k - int(rng.binomial(shape.k, shape.off_topic))
        docs = [int(d) for d in rng.choice(pool, size=on_topic, replace=False, p=doc_weights)]
        while len(docs) < shape.k:
            noise = int(rng.integers(corpus))
            if noise not in docs:
                docs.insert(int(rng.integers(len(docs) + 1)), noise)
        requests.append(TraceRequest(i, tuple(docs), arrival_s=round(float(arrivals[i]), 6)))
    return requests


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ordering.topic_traces", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="contextpilot")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-n", "--requests", type=int, default=500)
    parser.add_argument("--out", type=Path, required=True, help="JSONL trace to write")
    args = parser.parse_args(argv)
    try:
        write_trace(args.out, topic_cluster_trace(args.requests, SHAPES[args.shape], seed=args.seed))
    except (InvalidInputError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
