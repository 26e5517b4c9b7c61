"""Building a lexical index prints no bm25s debug line unless debug logging is on (``-v``)."""

from __future__ import annotations

import logging

import pytest

from specrag.retrieval.lexical.bm25 import LexicalIndex


def test_bm25s_debug_lines_follow_the_applications_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)  # the commands' level without -v
    LexicalIndex.build(["the first passage", "the second passage"])
    assert not logging.getLogger("bm25s").isEnabledFor(logging.DEBUG)
    caplog.set_level(logging.DEBUG)  # with -v
    assert logging.getLogger("bm25s").isEnabledFor(logging.DEBUG)
