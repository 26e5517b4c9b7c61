import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.ordering.session_dedup import SessionDeduplicator
from specrag.cache import HintConfig, order_hint
from specrag.errors import InvalidInputError


def test_order_hint_restates_the_retrieval_ranking_only_when_the_order_changed() -> None:
    config = HintConfig(order_template="Rank: {order}", doc_label="<{doc_id}>", order_separator=", ")
    assert order_hint([2, 1, 4], [1, 2, 4], config) == "Rank: <2>, <1>, <4>"
    assert order_hint([2, 1, 4], [2, 1, 4], config) is None
    assert order_hint([2, 1], [1, 2], HintConfig(order_hint=False)) is None
    with pytest.raises(InvalidInputError):
        order_hint([1, 2], [1, 3], config)


def test_second_turn_keeps_only_new_documents_and_points_to_the_turn_of_the_others() -> None:
    dedup = SessionDeduplicator(HintConfig(location_template="see {label} from turn {turn}"))
    first = dedup.dedup("c1", [1, 2, 4])
    assert first.kept == (1, 2, 4) and first.hints == ()
    second = dedup.dedup("c1", [1, 5, 2])
    assert second.kept == (5,)
    assert second.repeated == (1, 2)
    assert second.hint_text() == "see [Doc 1] from turn 1\nsee [Doc 2] from turn 1"
    assert dedup.dedup("c2", [1]).kept == (1,)  # other conversations are independent
    dedup.end("c1")
    assert dedup.dedup("c1", [1]).kept == (1,)


turns = st.lists(st.lists(st.integers(0, 15), max_size=6, unique=True), min_size=1, max_size=8)


@given(turns)
def test_dedup_never_drops_a_document_the_session_has_not_seen(session: list[list[int]]) -> None:
    dedup = SessionDeduplicator(max_sessions=2)
    seen: set[int] = set()
    for docs in session:
        result = dedup.dedup("c", docs)
        assert set(result.kept) == set(docs) - seen
        assert set(result.repeated) == set(docs) & seen
        assert len(result.hints) == len(result.repeated)
        seen |= set(docs)


def test_sessions_are_bounded() -> None:
    dedup = SessionDeduplicator(max_sessions=2)
    for conv in ("a", "b", "c"):
        dedup.dedup(conv, [1])
    assert len(dedup) == 2
    assert dedup.dedup("a", [1]).kept == (1,)  # the oldest was forgotten, nothing wrongly dropped
