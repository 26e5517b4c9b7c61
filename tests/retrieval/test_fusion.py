from __future__ import annotations

import numpy as np
import pytest

from specrag.errors import InvalidInputError
from specrag.retrieval.lexical.fusion import MISSING_SCORE, FusionConfig, distinct_in_order, fuse


def ranks(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_a_passage_both_channels_rank_high_comes_first() -> None:
    passages, scores = fuse(ranks(7, 3, 9), ranks(4, 7, 5), 3, FusionConfig(rrf_k=10))
    assert passages[0] == 7
    assert scores[0] == pytest.approx(1 / 11 + 1 / 12)
    assert list(scores) == sorted(scores, reverse=True)


def test_dense_repeats_and_padding_count_once_at_the_best_rank() -> None:
    # Synthetic rows map several dense hits to one passage; -1 is faiss's padding.
    assert list(distinct_in_order(ranks(5, 5, -1, 2, 5, 1))) == [5, 2, 1]
    passages, _ = fuse(ranks(), ranks(5, 5, -1, 2), 4, FusionConfig())
    assert list(passages) == [5, 2, -1, -1]


def test_short_results_are_padded() -> None:
    passages, scores = fuse(ranks(1), ranks(), 3, FusionConfig())
    assert list(passages) == [1, -1, -1]
    assert scores[1] == scores[2] == np.float32(MISSING_SCORE)


def test_equal_scores_break_to_the_dense_rank_then_the_lexical_rank() -> None:
    # 8 is dense #1 and 3 lexical #1: equal RRF scores; the dense one goes first, every time.
    passages, scores = fuse(ranks(3), ranks(8), 2, FusionConfig())
    assert list(passages) == [8, 3] and scores[0] == scores[1]


def test_weights_and_depth_change_the_ranking() -> None:
    lexical, dense = ranks(1, 2), ranks(2, 1)
    assert fuse(lexical, dense, 1, FusionConfig(lexical_weight=2.0))[0][0] == 1
    assert fuse(lexical, dense, 1, FusionConfig(dense_weight=2.0))[0][0] == 2
    assert list(fuse(ranks(1, 2, 3), ranks(), 3, FusionConfig(depth=2))[0]) == [1, 2, -1]


def test_a_question_naming_an_identifier_weighs_the_lexical_ranking_more() -> None:
    # 1 is lexical #1 only, 2 dense #1 and lexical #5: plain RRF puts 2 first.
    lexical, dense = ranks(1, 9, 8, 7, 2), ranks(2)
    assert fuse(lexical, dense, 1, FusionConfig())[0][0] == 2
    assert fuse(lexical, dense, 1, FusionConfig(), names_identifier=True)[0][0] == 1
    assert fuse(lexical, dense, 1, FusionConfig(identifier_weight=1), names_identifier=True)[0][0] == 2


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(InvalidInputError):
        FusionConfig(depth=0)
    with pytest.raises(InvalidInputError):
        FusionConfig(identifier_weight=0)
    with pytest.raises(InvalidInputError):
        FusionConfig(rrf_k=-1)
