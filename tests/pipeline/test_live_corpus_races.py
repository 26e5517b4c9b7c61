"""Writes racing searches: writers put, replace and delete documents through the live corpus
while searchers run hybrid searches, one-shot and staged; neither side ever fails."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from specrag.pipeline.store.live_corpus import COMPACT_SHARE, LiveCorpus
from specrag.retrieval.corpus import Passage
from tests.helpers.live_corpus import new_passages, text_corpus

RUN_S = 12.0  # per index kind (tens of seconds in all): hundreds of writes, thousands of searches


@pytest.fixture(autouse=True)
def frequent_thread_switches() -> Iterator[None]:
    """Threads take turns every 10 µs instead of every 5 ms, so that a writer runs in the middle
    of a search's Python loops as it would now and then over hours of serving."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(interval)


def run_until(stop: threading.Event, errors: list[BaseException], work: Callable[[int], None]) -> None:
    """Call ``work(i)`` for i = 0, 1, ... until ``stop``; the first exception is recorded and ends it."""
    step = 0
    try:
        while not stop.is_set():
            work(step)
            step += 1
    except BaseException as error:  # reported by the test
        errors.append(error)
        stop.set()


def writes(corpus: LiveCorpus) -> Callable[[int], None]:
    fresh = new_passages(2000, seed=11, prefix="race")

    def write(step: int) -> None:
        corpus.put(fresh[2 * step : 2 * step + 2])  # two new documents
        corpus.put([Passage(f"t{step % 50}", "", fresh[(7 * step) % 2000].text)])  # a replacement
        if step % 3 == 0:
            corpus.delete([fresh[2 * step].id])

    return write


def searches(corpus: LiveCorpus, staged: bool) -> Callable[[int], None]:
    index = corpus.index
    texts = [passage.text for passage in new_passages(50, seed=12, prefix="query")]
    vectors = index.embedder.embed(texts) if index.embedder is not None else None
    assert vectors is not None

    def search(step: int) -> None:
        text, vector = texts[step % len(texts)], vectors[step % len(texts)]
        if staged:
            stages = list(index.search_staged(vector, 5, query_text=text))
            assert stages[-1].done
            ids = stages[-1].ids
        else:
            _, ids = index.search(vector, 5, query_text=text)
        assert len(set(ids.tolist())) == 5 and ids.min() >= 0  # five passages, each once

    return search


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_writers_and_searchers_in_threads_never_fail(tmp_path: Path, kind: str) -> None:
    corpus = text_corpus(tmp_path, kind, compact_share=COMPACT_SHARE)  # compactions race too
    stop, errors = threading.Event(), list[BaseException]()
    work = [writes(corpus), searches(corpus, staged=False), searches(corpus, staged=True)]
    threads = [threading.Thread(target=run_until, args=(stop, errors, job)) for job in work]
    for thread in threads:
        thread.start()
    stop.wait(RUN_S)
    stop.set()
    for thread in threads:
        thread.join(60)
    corpus.wait_for_compaction()
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
