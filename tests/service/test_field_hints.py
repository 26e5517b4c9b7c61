"""Near-misses get a hint, and a JSON error keeps its position."""

from __future__ import annotations

import pytest

from specrag.errors import InvalidInputError
from specrag.service.http.bodies import BATCH_FIELDS, RAG_FIELDS, chat_request, check_fields, field_hint
from specrag.service.http.wire import parse_json_object


@pytest.mark.parametrize(
    ("field", "known", "hint"),
    [
        ("question", RAG_FIELDS, "query"),  # what other RAG APIs call it
        ("top_k", RAG_FIELDS, "k"),
        ("querry", RAG_FIELDS, "query"),  # a typo
        ("sessionid", RAG_FIELDS, "session_id"),
        ("max_new_tokens", BATCH_FIELDS, "max_tokens"),
        ("questions", BATCH_FIELDS, "queries"),
        ("colour", RAG_FIELDS, None),  # nothing close: no hint
        ("question", BATCH_FIELDS, None),  # the alias is not a field there
    ],
)
def test_the_field_meant_is_named(field: str, known: frozenset[str], hint: str | None) -> None:
    assert field_hint(field, known) == hint


def test_an_unknown_field_says_which_one_was_meant() -> None:
    with pytest.raises(InvalidInputError, match=r"unknown fields: question \(did you mean 'query'\?\)"):
        check_fields({"question": "What does GNU ed do?"}, RAG_FIELDS, "unknown fields")
    with pytest.raises(InvalidInputError, match=r"unknown fields: colour$"):
        check_fields({"colour": 1}, RAG_FIELDS, "unknown fields")


def test_a_truncated_body_names_where_it_ends() -> None:
    with pytest.raises(
        InvalidInputError, match=r"not valid JSON \(Unterminated string starting at: line 2, column 2\)"
    ):
        parse_json_object(b'{"query":\n "what is')


def test_a_chat_request_carries_its_earlier_user_messages() -> None:
    request = chat_request(
        {
            "messages": [
                {"role": "user", "content": "What does GNU ed do?"},
                {"role": "assistant", "content": "It edits lines."},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                {"role": "user", "content": "And its restricted version?"},
            ]
        }
    )
    assert request.question == "And its restricted version?"
    assert request.previous_questions == ("What does GNU ed do?",)  # the image is left out
