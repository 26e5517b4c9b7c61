"""How a follow-up's query is made: the question and the previous ones, weighted, in both channels."""

from __future__ import annotations

import numpy as np
import pytest

from specrag.errors import InvalidInputError
from specrag.retrieval.conversational import conversation_query, question_weights
from specrag.service.run.assets import Assets

FIRST = "What is the module `zipfile` for?"
SECOND = "And which of its functions reads the archive?"
QUESTION = "And which of its methods closes it?"


def test_a_first_question_is_searched_alone(tiny_assets: Assets) -> None:
    index = tiny_assets.index
    query = conversation_query(index, QUESTION)
    assert query.joined == 0 and query.text == QUESTION
    assert np.array_equal(query.vector, index.embed_query(QUESTION))
    assert conversation_query(index, QUESTION, [FIRST], weight=0).joined == 0


def test_the_previous_questions_weigh_less_the_older_they_are(tiny_assets: Assets) -> None:
    index = tiny_assets.index
    query = conversation_query(index, QUESTION, ["an old subject", FIRST, SECOND], weight=0.5, turns=2)
    assert query.joined == 2
    # BM25 counts a term once per occurrence: the question 4 times, the one before twice, then once.
    assert query.text.split("\n") == [FIRST, SECOND, SECOND, *[QUESTION] * 4]
    vectors = np.stack([index.embed_query(text) for text in (FIRST, SECOND, QUESTION)])
    expected = (np.array([0.25, 0.5, 1.0])[:, None] * vectors).sum(axis=0)
    assert np.allclose(query.vector, expected / np.linalg.norm(expected), atol=1e-6)
    assert question_weights(2, 0.5) == [0.25, 0.5, 1.0]


@pytest.mark.parametrize(("weight", "turns"), [(1.5, 2), (-0.1, 2), (0.5, -1)])
def test_bad_settings_are_refused(tiny_assets: Assets, weight: float, turns: int) -> None:
    with pytest.raises(InvalidInputError):
        conversation_query(tiny_assets.index, QUESTION, [FIRST], weight=weight, turns=turns)
