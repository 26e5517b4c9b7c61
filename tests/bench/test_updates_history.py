"""bench.updates' history measurement: a start after a long history costs what one after a short one does."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.updates import history


def test_the_log_after_a_start_does_not_grow_with_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history, "HISTORY_PASSAGES", 300)
    monkeypatch.setattr(history, "HISTORY_DOCUMENTS", 20)
    monkeypatch.setattr(history, "HISTORY_REPLACEMENTS", 400)  # each document replaced 20 times
    measured = history.measure_history(argparse.Namespace(dim=16, seed=0), tmp_path)
    first, last = measured["after_first"], measured["after_all"]
    assert set(first) == {"log_bytes", "log_bytes_after_start", "start_up_s", "rss_mb", "rss_replay_mb"}
    assert last["log_bytes_after_start"] <= 2 * first["log_bytes_after_start"]
