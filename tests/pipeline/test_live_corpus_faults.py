"""A write whose apply to the index fails after its log commit: acknowledged as durable but not
visible yet, writes suspended until the corpus caught up, and then no row out of place."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specrag.errors import WritesSuspendedError
from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.retrieval.corpus import Passage
from specrag.retrieval.live_index import AddedLexical, Growable, Visibility
from tests.helpers.live_corpus import new_passages, text_corpus

KINDS = ["ivf", "hnsw"]
# Where the apply fails: the lexical channel, the searcher before or after it took the vectors
# (a half-done add), the visibility swap.
STEPS = ["lexical", "vector", "vector-after-add", "visibility"]


class Fault:
    """Makes one step of the apply raise while ``failing`` (the first call only, unless ``always``)."""

    def __init__(self, always: bool = False) -> None:
        self.failing = True
        self.always = always
        self.raised = 0

    def wrap(self, function: Callable[..., Any], after: bool = False) -> Callable[..., Any]:
        def failing(*args: Any, **kwargs: Any) -> Any:
            result = function(*args, **kwargs) if after else None
            if self.failing:
                self.raised += 1
                self.failing = self.always
                raise RuntimeError("injected fault")
            return result if after else function(*args, **kwargs)

        return failing


def inject(corpus: LiveCorpus, step: str, fault: Fault, monkeypatch: pytest.MonkeyPatch) -> None:
    searcher = corpus.index.searcher
    assert isinstance(searcher, Growable)
    if step == "lexical":
        monkeypatch.setattr(AddedLexical, "changed", fault.wrap(AddedLexical.changed))
    elif step == "vector":
        monkeypatch.setattr(searcher, "add", fault.wrap(searcher.add))
    elif step == "vector-after-add":
        monkeypatch.setattr(searcher, "add", fault.wrap(searcher.add, after=True))
    else:
        monkeypatch.setattr(Visibility, "changed", fault.wrap(Visibility.changed))


def assert_consistent(corpus: LiveCorpus, documents: list[Passage], gone: list[int]) -> None:
    """Store and index agree row by row, each of ``documents`` is found first by its own text
    (dense and fused), and none of the rows ``gone`` is found."""
    index, store = corpus.index, corpus.store
    searcher = index.searcher
    assert isinstance(searcher, Growable)
    assert len(store) == len(index.passage_ids) == len(index.visible_rows) == searcher.next_row
    assert searcher.ntotal == len(store)  # no row twice (no compaction here)
    for row in np.flatnonzero(index.visible_rows).tolist():
        passage_id = index.passage_ids[row]
        assert store.passage(row).id == passage_id and store.row_of(passage_id) == row
    for passage in documents:
        row = store.row_of(passage.id)
        assert corpus.get(passage.id).text == passage.text
        query = index.embed_query(passage.text)
        dense = index.ranked_rows(index.search(query, 5)[1])
        fused = index.ranked_rows(index.search(query, 5, query_text=passage.text)[1])
        assert dense[0] == fused[0] == row
        assert not set(dense) & set(gone) and not set(fused) & set(gone)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("step", STEPS)
def test_a_failed_apply_is_acknowledged_caught_up_by_the_next_write_and_leaves_no_drift(
    tmp_path: Path, kind: str, step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = text_corpus(tmp_path, kind)
    fault = Fault()
    inject(corpus, step, fault, monkeypatch)
    (added,) = new_passages(1, seed=1)
    replaced = Passage("t5", "", new_passages(1, seed=2)[0].text)
    written = corpus.put([added, replaced])
    assert fault.raised == 1
    assert [(w.version, w.created, w.visible) for w in written] == [(1, True, False), (2, False, False)]
    assert corpus.suspended is not None and "injected fault" in corpus.suspended
    assert corpus.get("t5").text == replaced.text  # durable: the log holds it
    later = new_passages(1, seed=3)
    assert [w.visible for w in corpus.put(later)] == [True]  # caught up first
    assert corpus.suspended is None
    assert corpus.delete(["t6"])
    assert_consistent(corpus, [added, replaced, *later], gone=[5, 6])


@pytest.mark.parametrize("kind", KINDS)
def test_writes_are_suspended_while_the_catch_up_fails(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = text_corpus(tmp_path, kind)
    fault = Fault(always=True)
    inject(corpus, "visibility", fault, monkeypatch)  # the vectors' add, once done, is not retried
    first = new_passages(2, seed=7)  # seed 4 is text_corpus's own: new-4-0 would repeat t0 word for word
    assert [w.visible for w in corpus.put(first)] == [False, False]
    with pytest.raises(WritesSuspendedError, match="injected fault"):
        corpus.put(new_passages(1, seed=5))
    with pytest.raises(WritesSuspendedError, match="injected fault"):
        corpus.delete(["t1"])
    assert not corpus.catch_up() and corpus.suspended is not None
    assert fault.raised == 4  # each refused write tried to catch up first
    fault.failing = False
    assert corpus.catch_up() and corpus.suspended is None
    assert corpus.catch_up()  # nothing left: nothing changes
    later = new_passages(1, seed=6)
    assert corpus.put(later)[0].visible
    assert_consistent(corpus, [*first, *later], gone=[])
