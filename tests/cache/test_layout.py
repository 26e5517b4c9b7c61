import dataclasses
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specrag.cache import Segment, build_layout
from specrag.cache.residency import chain_block_keys
from specrag.errors import InvalidInputError


def test_unpadded_layout_concatenates_segments_in_order() -> None:
    layout = build_layout([1, 2], [("a", [10, 11, 12]), (7, [20])], [30, 31], [40])
    assert layout.token_ids == (1, 2, 10, 11, 12, 20, 40, 30, 31)
    assert [(s.kind, s.doc_id, s.start, s.end) for s in layout.segments] == [
        ("system", None, 0, 2),
        ("document", "a", 2, 5),
        ("document", 7, 5, 6),
        ("hint", None, 6, 7),
        ("question", None, 7, 9),
    ]
    assert layout.document_ids() == ("a", 7)


def test_padding_puts_system_and_documents_on_block_boundaries() -> None:
    layout = build_layout(
        [1, 2, 3], [("a", [10] * 5), ("b", [20] * 4), ("c", [])], [30], [40, 41], block_size=4, pad_token_id=0
    )
    system, a, b, c, hint, question = layout.segments
    assert (system.start, system.end) == (0, 4)
    assert (a.start, a.end) == (4, 12)
    assert (b.start, b.end) == (12, 16)  # already a multiple: no padding
    assert (c.start, c.end) == (16, 16)
    assert (hint.start, hint.end, question.end) == (16, 18, 19)  # hint and question stay unpadded
    assert layout.token_ids[:12] == (1, 2, 3, 0, 10, 10, 10, 10, 10, 0, 0, 0)


def test_two_prompts_sharing_a_first_document_diverge_on_a_block_boundary() -> None:
    first = build_layout([1], [("a", [5] * 3), ("b", [6] * 2)], [9], block_size=4, pad_token_id=0)
    second = build_layout([1], [("a", [5] * 3), ("c", [7] * 2)], [9], block_size=4, pad_token_id=0)
    diverge = next(
        i for i, (x, y) in enumerate(zip(first.token_ids, second.token_ids, strict=False)) if x != y
    )
    assert diverge % 4 == 0


@pytest.mark.parametrize(
    ("kwargs", "docs"),
    [
        ({"block_size": 4}, [("a", [1])]),
        ({"block_size": 0, "pad_token_id": 0}, [("a", [1])]),
        ({}, [("a", [1]), ("a", [2])]),
    ],
)
def test_invalid_layouts_are_rejected(kwargs: dict[str, int], docs: list[tuple[str, list[int]]]) -> None:
    with pytest.raises(InvalidInputError):
        build_layout([1], docs, [2], **kwargs)  # type: ignore[arg-type]


@given(
    st.lists(st.integers(1, 9), max_size=9),
    st.lists(st.lists(st.integers(10, 99), max_size=9), max_size=6),
    st.lists(st.integers(1, 9), max_size=3),
    st.integers(1, 5),
)
def test_padded_segments_tile_the_prompt_on_block_boundaries(
    system: list[int], documents: list[list[int]], hint: list[int], block: int
) -> None:
    layout = build_layout(system, list(enumerate(documents)), [7], hint, block_size=block, pad_token_id=0)
    segments = layout.segments
    assert segments[0].start == 0 and segments[-1].end == len(layout.token_ids)
    assert all(a.end == b.start for a, b in itertools.pairwise(segments))  # contiguous
    for seg, tokens in zip(segments, [system, *documents], strict=False):
        assert seg.end % block == 0  # system and documents end on a block boundary
        padded = layout.token_ids[seg.start : seg.end]
        assert padded == (*tokens, *[0] * (len(padded) - len(tokens))) and len(padded) - len(tokens) < block


def reference_layout(
    system: list[int], documents: list[list[int]], question: list[int], hint: list[int], block: int | None
) -> tuple[tuple[int, ...], list[tuple[str, int | None, int, int]]]:
    """The layout built the plain way, one segment at a time, padding each to the block."""
    tokens: list[int] = []
    segments: list[tuple[str, int | None, int, int]] = []
    for kind, doc_id, ids, padded in [
        ("system", None, system, True),
        *[("document", i, ids, True) for i, ids in enumerate(documents)],
        *([("hint", None, hint, False)] if hint else []),
        ("question", None, question, False),
    ]:
        start = len(tokens)
        tokens.extend(ids)
        while padded and block and len(tokens) % block:
            tokens.append(0)
        segments.append((kind, doc_id, start, len(tokens)))
    return tuple(tokens), segments


@given(
    st.lists(st.integers(1, 9), max_size=9),
    st.lists(st.lists(st.integers(10, 99), max_size=9), max_size=6),
    st.lists(st.integers(1, 9), max_size=3),
    st.lists(st.integers(1, 9), max_size=3),
    st.one_of(st.none(), st.integers(1, 5)),
)
def test_layout_equals_the_plain_construction(
    system: list[int], documents: list[list[int]], question: list[int], hint: list[int], block: int | None
) -> None:
    pad = {} if block is None else {"block_size": block, "pad_token_id": 0}
    layout = build_layout(system, list(enumerate(documents)), question, hint, **pad)
    tokens, segments = reference_layout(system, documents, question, hint, block)
    assert layout.token_ids == tokens
    assert [(s.kind, s.doc_id, s.start, s.end) for s in layout.segments] == segments
    assert all(isinstance(s, Segment) for s in layout.segments)


def test_block_keys_are_the_prompt_s_chain_computed_once_and_not_carried_by_replace() -> None:
    layout = build_layout(
        [1, 2, 3], [("a", [10] * 5), ("b", [20] * 4)], [30, 31], block_size=4, pad_token_id=0
    )
    keys = layout.block_keys(4)
    assert list(keys) == chain_block_keys(layout.token_ids, 4)
    assert layout.block_keys(4) is keys  # asked again (every replica compared): not recomputed
    assert list(layout.block_keys(8)) == chain_block_keys(layout.token_ids, 8)
    # A prefix's keys are the first keys of the whole: what the tree slices for a document path.
    assert list(keys[:2]) == chain_block_keys(layout.token_ids[:9], 4)
    other = dataclasses.replace(layout, token_ids=(7,) * len(layout.token_ids))
    assert list(other.block_keys(4)) == chain_block_keys(other.token_ids, 4) != list(keys)
    assert layout == build_layout(
        [1, 2, 3], [("a", [10] * 5), ("b", [20] * 4)], [30, 31], block_size=4, pad_token_id=0
    )
