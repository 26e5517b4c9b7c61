"""bench.retrieval.embedding: both schedules see every window, and give the same vectors."""

from __future__ import annotations

import pytest

from bench.retrieval.embedding import SCHEDULES, measure, windows

pytest.importorskip("transformers", reason="MiniLM runs on torch and transformers (the engine's)")


def test_windows_hold_one_batch_per_core_in_length_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("bench.retrieval.embedding.BATCH", 2)
    monkeypatch.setattr("bench.retrieval.embedding.os.sched_getaffinity", lambda _: {0, 1})
    texts = ["a" * n for n in (5, 1, 4, 2, 3)]
    assert windows(texts) == [["a", "aa", "aaa", "aaaa"], ["aaaaa"]]


def test_both_schedules_embed_every_window_to_the_same_vectors() -> None:
    texts = [f"passage {n} on sockets, threads and {'files ' * (n % 7)}" for n in range(70)]
    result = measure(texts)
    assert result["passages"] == 70 and result["windows"] >= 2
    assert set(result["docs_per_s"]) == set(SCHEDULES) and result["min_cosine"] > 0.9999
    low, high = result["speedup_ci"]
    assert low <= result["speedup"] <= high
