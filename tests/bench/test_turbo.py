"""bench.pipeline.turbo's measures: the KV error (max over layers, keys and values apart), the
frontier's paired accuracy, its default, its TTFT bookkeeping on the simulated engine, and the
accuracy pass: questions at once, and ``--quick``'s stop at the first qualifying point."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from bench.pipeline.turbo import relative_errors
from bench.pipeline.turbo_frontier import (
    FULL,
    NO_QUESTIONS_NOTE,
    QUICK_STOP_NOTE,
    Point,
    answer_frontier,
    answer_points,
    choose_default,
    frontier,
    frontier_points,
    measure_ttft,
    paired_accuracy,
)
from specrag.pipeline.engines.protocol import Sampling
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine


def test_relative_errors_take_the_worst_layer() -> None:
    reference = torch.ones(3, 2, 2, 4, 8)
    actual = reference.clone()
    actual[1, 0] *= 1.01  # layer 1's keys 1 % off
    actual[2, 1] *= 0.95  # layer 2's values 5 % off
    errors = relative_errors(actual.to(torch.bfloat16), reference)
    assert errors["keys"] == 0.0078125  # bfloat16 rounds 1.01 to 1.0078125
    assert errors["values"] == 0.05078125  # and 0.95 to 0.94921875
    assert relative_errors(reference, reference) == {"keys": 0.0, "values": 0.0}


def record(full: float, point: float, name: str = "alone/fresh=0") -> dict[str, Any]:
    return {FULL: {"accuracy": full}, name: {"accuracy": point}}


def test_accuracy_is_paired_with_full_prefill_question_by_question() -> None:
    paired = paired_accuracy([record(1, 0)] * 6 + [record(1, 1)] * 4, "alone/fresh=0")
    assert paired["accuracy"] == 0.4 and paired["accuracy_diff"] == -0.6
    low, high = paired["accuracy_diff_ci"]
    assert -1 < low <= -0.6 <= high < 0  # lost 6 of 10, every time it differed


def test_the_default_is_the_fastest_point_that_keeps_accuracy() -> None:
    points = [
        {"name": "a", "ttft_over_full": 0.05, "accuracy_diff_ci": [-0.12, -0.01]},  # loses accuracy
        {"name": "b", "ttft_over_full": 0.20, "accuracy_diff_ci": [-0.04, 0.02]},
        {"name": "c", "ttft_over_full": 0.30, "accuracy_diff_ci": [-0.02, 0.03]},
        {"name": "d", "ttft_over_full": 0.10, "accuracy_diff_ci": [-0.06, 0.01]},  # lower end too low
    ]
    assert choose_default(points)["name"] == "b"
    assert choose_default(points)["accuracy_diff_ci"] == [-0.04, 0.02]
    none = choose_default(points[:1] + points[3:])
    assert none["name"] is None and "no point" in none["statement"]
    assert choose_default([{"name": "x", "ttft_over_full": 0.1}])["name"] is None  # no accuracy measured


async def test_the_frontier_on_the_simulated_engine(tiny_assets: Assets) -> None:
    """Every point is measured on the same prompts as full prefill; each loads the system prompt
    and every document but its fresh ones (cold: all it loads is counted as cached)."""
    engine = SimulatedEngine(time_scale=0, max_model_len=4096, document_kv=True)
    builder = PromptBuilder(tiny_assets.tokenizer, tiny_assets.store, block_size=engine.block_size)
    prompts = [([0, 1, 2], "What does asyncio.run do?"), ([3, 4, 5], "How does pathlib read a file?")]
    points = frontier_points(3)
    filled: list[Sampling] = []

    async def fill(prompt: Sequence[int], sampling: Sampling) -> None:
        filled.append(sampling)

    try:
        ttft = await measure_ttft(engine, builder, prompts, points, 2, fill)
    finally:
        await engine.close()
    assert len(points) == 8 and len(filled) == 8 * 2
    assert all(len(seconds) == 4 for seconds in ttft["seconds"].values())
    assert ttft["cached_tokens"][FULL] == [0] * 4  # cold: the cache is reset before each request
    for point in points:
        for (rows, question), cached in zip(prompts * 2, ttft["cached_tokens"][point.name], strict=True):
            layout = point.layout(builder, rows, question)
            assert cached == layout.stored_spans(point.fresh)[-1][1]
            top = [int(doc) for doc in layout.document_ids()[len(rows) - point.fresh :]]
            assert top == list(rows[: point.fresh])  # the top ones last, in rank order
    table = frontier(ttft, [], points)
    assert [row["name"] for row in table] == [point.name for point in points]
    assert all(row["ttft_over_full"] > 0 and row["accuracy_diff_ci"] is None for row in table)
    assert {row["accuracy_note"] for row in table} == {NO_QUESTIONS_NOTE}


def test_quick_stops_at_the_first_qualifying_point() -> None:
    """Points answered in the order given, every question before the next point; the first that
    keeps accuracy ends the pass: the later ones are never asked and the frontier says so."""
    losing, keeping = frontier_points(0)
    never = Point(losing.variant, 1)
    accuracy = {None: 1.0, losing: 0.0, keeping: 1.0, never: 1.0}
    asked: list[tuple[int, Point | None]] = []
    busy = peak = 0

    async def answer(question: int, point: Point | None) -> dict[str, Any]:
        nonlocal busy, peak
        busy += 1
        peak = max(peak, busy)
        await asyncio.sleep(0)
        busy -= 1
        asked.append((question, point))
        return {"accuracy": accuracy[point]}

    points = [losing, keeping, never]
    records = asyncio.run(answer_points(5, points, answer, concurrency=2, stop_at_first=True))
    assert [point for _, point in asked] == [None] * 5 + [losing] * 5 + [keeping] * 5
    assert peak == 2  # questions at once, never more than asked
    seconds = {name: [1.0] for name in [FULL, *(point.name for point in points)]}
    table = frontier({"seconds": seconds}, records, points)
    assert [row["accuracy_diff"] for row in table] == [-1.0, 0.0, None]
    assert table[2]["accuracy_diff_ci"] is None and table[2]["accuracy_note"] == QUICK_STOP_NOTE
    assert "accuracy_note" not in table[0]
    assert choose_default(table)["name"] == keeping.name

    asked.clear()
    every = asyncio.run(answer_points(5, points, answer, concurrency=2))
    assert len(asked) == 5 * 4 and all(len(record) == 4 for record in every)


async def test_the_accuracy_pass_on_the_simulated_engine(tiny_assets: Assets) -> None:
    """Through the controller: each question in full first, its documents stored in the point's
    variant, then the point, which loads every document but its fresh ones."""
    engine = SimulatedEngine(time_scale=0, max_model_len=4096, document_kv=True)
    builder = PromptBuilder(tiny_assets.tokenizer, tiny_assets.store, block_size=engine.block_size)
    pairs = [("What does asyncio.run do?", "run"), ("How does pathlib read a file?", "read_text")]
    points = frontier_points(2, [1, 0])
    filled: list[Sampling] = []

    async def fill(prompt: Sequence[int], sampling: Sampling) -> None:
        filled.append(sampling)

    try:
        records = await answer_frontier(
            engine, builder, tiny_assets.index, pairs, 2, 4, points, fill, concurrency=2, stop_at_first=True
        )
    finally:
        await engine.close()
    # the simulated engine answers alike every way: the first point asked keeps accuracy
    assert [sorted(record) for record in records] == [sorted(["question", "gold", FULL, points[0].name])] * 2
    assert len(filled) == 2 and all(sampling.document_kv_prefix == 0 for sampling in filled)  # alone
    for record, sampling in zip(records, filled, strict=True):
        stored = sampling.document_kv[-1][1]  # the system prompt and both documents
        assert 0 < record[points[0].name]["loaded_tokens"] < stored  # the top document fresh
