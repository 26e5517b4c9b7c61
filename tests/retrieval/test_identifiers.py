"""Which words of a question are code identifiers."""

from __future__ import annotations

import pytest

from specrag.retrieval.lexical.identifiers import named_identifiers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Where is the function `FTP.sendeprt` defined?", ["FTP.sendeprt"]),
        ("What does pathlib.Path.read_bytes return?", ["pathlib.Path.read_bytes"]),
        ("How do I use read_bytes or __exit__?", ["read_bytes", "__exit__"]),
        ("Is CheckList a widget, and HTTPServer a class?", ["CheckList", "HTTPServer"]),
        ("Why does open() fail?", ["open"]),
        ("What does `with` do?", ["with"]),
        ("Where is read\u200b_bytes or ＣｈｅｃｋＬｉｓｔ?", ["read_bytes", "CheckList"]),
    ],
)
def test_identifiers_are_found(text: str, expected: list[str]) -> None:
    assert named_identifiers(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "Return the first element. Which module defines it?",
        "open and possibly create a file",
        "HTTP status codes, e.g. 404",
        "The ``   `` marks are empty: `` ``",
    ],
)
def test_prose_names_no_identifier(text: str) -> None:
    assert named_identifiers(text) == []
