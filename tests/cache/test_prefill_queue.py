import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrag.cache import RatioQueue, get_policy
from specrag.cache.prefill_queue import WindowScheduler
from specrag.errors import InvalidInputError
from tests.helpers.builders import Clock
from tests.helpers.tree import layout, served_tree


def test_highest_cached_to_compute_ratio_goes_first() -> None:
    queue: RatioQueue[str] = RatioQueue(starvation_window_s=10.0, clock=Clock())
    queue.push("cold", cached_tokens=0, compute_tokens=1000)
    queue.push("warm", cached_tokens=900, compute_tokens=100)
    queue.push("half", cached_tokens=500, compute_tokens=500)
    queue.push("half-later", cached_tokens=50, compute_tokens=50)
    assert [queue.pop() for _ in range(4)] == ["warm", "half", "half-later", "cold"]
    with pytest.raises(IndexError):
        queue.pop()


def test_a_request_waiting_past_the_window_is_served_next() -> None:
    clock = Clock()
    queue: RatioQueue[str] = RatioQueue(starvation_window_s=5.0, clock=clock)
    queue.push("cold", 0, 1000)
    clock.now = 1.0
    for i in range(3):
        queue.push(f"warm{i}", 900, 100)
    assert queue.pop() == "warm0"
    clock.now = 6.5  # "cold" has waited 6.5 s > 5 s; the warm ones only 5.5 s but they came later
    assert queue.pop() == "cold"
    assert queue.pop() == "warm1"
    assert len(queue) == 1


def test_starved_requests_are_not_served_twice() -> None:
    clock = Clock()
    queue: RatioQueue[int] = RatioQueue(starvation_window_s=0.0, clock=clock)
    for i in range(200):
        queue.push(i, cached_tokens=i, compute_tokens=1)
    clock.now = 1.0
    popped = [queue.pop() for _ in range(200)]
    assert popped == list(range(200))  # all starved: arrival order
    assert len(queue) == 0


def prompt_tokens(docs: tuple[int, ...]) -> int:
    return len(layout(docs).token_ids)


def test_window_admits_the_request_with_the_most_cached_and_orders_it_for_the_tree() -> None:
    tree, _ = served_tree((1, 2, 3))
    window: WindowScheduler[str] = WindowScheduler(10.0, window_requests=4, clock=Clock())
    for name, docs in (("cold", (7, 8)), ("warm", (3, 9, 1, 2)), ("half", (2, 1, 6))):
        window.push(name, docs, prompt_tokens(docs))
    name, ordering = window.pop(tree)
    assert name == "warm" and ordering.doc_ids[:3] == (1, 2, 3)
    assert ordering.cached == tree.cached_prefix(ordering.doc_ids)
    assert [window.pop(tree)[0] for _ in range(2)] == ["half", "cold"]
    with pytest.raises(IndexError):
        window.pop(tree)


def test_window_looks_only_at_the_oldest_requests_and_those_close_in_time() -> None:
    tree, _ = served_tree((1, 2, 3))
    clock = Clock()
    by_count: WindowScheduler[str] = WindowScheduler(10.0, window_requests=2, clock=clock)
    by_time: WindowScheduler[str] = WindowScheduler(10.0, window_requests=8, window_s=0.5, clock=clock)
    for name, docs, at in (("a", (7,), 0.0), ("b", (8,), 0.2), ("warm", (1, 2, 3), 1.0)):
        clock.now = at
        for window in (by_count, by_time):
            window.push(name, docs, prompt_tokens(docs))
    clock.now = 1.0
    assert by_count.pop(tree)[0] != "warm"  # third in line: outside a window of two
    assert by_time.pop(tree)[0] != "warm"  # arrived 1 s after the oldest: outside 0.5 s


def test_window_serves_a_starved_request_first() -> None:
    tree, _ = served_tree((1, 2, 3))
    clock = Clock()
    window: WindowScheduler[str] = WindowScheduler(5.0, clock=clock)
    window.push("cold", (7, 8), prompt_tokens((7, 8)))
    clock.now = 1.0
    window.push("warm", (1, 2, 3), prompt_tokens((1, 2, 3)))
    clock.now = 6.5
    assert window.pop(tree)[0] == "cold"


def test_window_puts_the_documents_waiting_requests_share_right_after_the_cached_prefix() -> None:
    tree, _ = served_tree((1, 2))
    window: WindowScheduler[str] = WindowScheduler(10.0, clock=Clock())
    window.push("first", (9, 5, 4, 1, 2), prompt_tokens((9, 5, 4, 1, 2)))
    window.push("next", (1, 2, 4, 5, 7), prompt_tokens((1, 2, 4, 5, 7)))
    window.push("other", (1, 5, 6), prompt_tokens((1, 5, 6)))
    name, ordering = window.pop(tree)
    assert name == "first"  # most cached for its length (ties to the earlier request)
    # after 1, 2 (cached) come the documents "next" also holds (it shares the prefix); 9 last
    assert ordering.doc_ids[:2] == (1, 2) and set(ordering.doc_ids[2:4]) == {4, 5}
    assert ordering.doc_ids[-1] == 9


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.permutations(range(6)).map(lambda p: tuple(p[:4])), max_size=8),
    st.lists(st.lists(st.integers(0, 8), min_size=1, max_size=5, unique=True), min_size=1, max_size=6),
)
def test_window_never_reuses_less_than_exact_for_the_request_it_admits(
    served: list[tuple[int, ...]], waiting: list[list[int]]
) -> None:
    tree, _ = served_tree(*served)
    window: WindowScheduler[int] = WindowScheduler(10.0, clock=Clock())
    for i, docs in enumerate(waiting):
        window.push(i, docs, prompt_tokens(tuple(docs)))
    admitted = []
    while len(window):
        index, ordering = window.pop(tree)
        admitted.append(index)
        exact = get_policy("exact").order(tree, waiting[index])
        assert sorted(ordering.doc_ids) == sorted(waiting[index])
        assert (ordering.cached.tokens, ordering.cached.docs) >= (exact.cached.tokens, exact.cached.docs)
        assert ordering.cached == tree.cached_prefix(ordering.doc_ids)
    assert sorted(admitted) == list(range(len(waiting)))


def test_a_removed_request_is_neither_admitted_nor_counted_as_sharing() -> None:
    tree, _ = served_tree((1, 2))
    window: WindowScheduler[str] = WindowScheduler(10.0, clock=Clock())
    gone, first = "gone", "first"
    window.push(first, (5, 9, 1, 2), prompt_tokens((5, 9, 1, 2)))
    window.push(gone, (1, 2, 9), prompt_tokens((1, 2, 9)))
    assert window.remove(gone) and not window.remove(gone)
    name, ordering = window.pop(tree)
    # with "gone" waiting, 9 (which it shares behind 1, 2) would come first; now rank order
    assert name == "first" and ordering.doc_ids[2:] == (5, 9)
    assert len(window) == 0


def test_window_rejects_bad_input() -> None:
    with pytest.raises(InvalidInputError):
        WindowScheduler(-1.0)
    with pytest.raises(InvalidInputError):
        WindowScheduler(1.0, window_requests=0)
    window: WindowScheduler[str] = WindowScheduler(1.0)
    with pytest.raises(InvalidInputError):
        window.push("x", (1, 1), 10)


def test_a_removed_request_is_not_served_nor_counted() -> None:
    queue: RatioQueue[str] = RatioQueue(starvation_window_s=10.0, clock=Clock())
    queue.push("gone", cached_tokens=90, compute_tokens=10)
    queue.push("first", cached_tokens=0, compute_tokens=10)
    assert queue.remove("gone") and not queue.remove("gone")
    assert len(queue) == 1
    assert queue.pop() == "first" and len(queue) == 0
    assert not queue.remove("first")  # served: no longer waiting
