"""bench.pipeline's arithmetic (the overlap bound from serial timelines, point choice, waste) and its
ideal and earliest runs on the simulated engine."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from bench.e2e.workload import TraceQuery
from bench.pipeline.analysis import (
    PHASES,
    earliest_summary,
    overlap,
    phase_summary,
    saturation_rps,
    search_ms,
    share_ci,
    wasted_share,
)
from bench.pipeline.calibration import nearest_point, sweep_points, with_ef_search
from bench.pipeline.ideal import bound_records
from bench.pipeline.options import parse_args
from bench.pipeline.points import halves
from bench.pipeline.report import headline
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import A, B, scripted_index


def record(
    i: int, ttft: float, search: float, embed: float, non_overlapped: float, **extra: Any
) -> dict[str, Any]:
    """A timeline as Timeline.to_dict exports it: retrieval and the part of it no prefill
    overlapped both count from the embedding's start, and ``non_overlapped`` is given here as
    the search's part of it."""
    return {
        "i": i,
        "ttft_ms": ttft,
        "embed_ms": embed,
        "retrieval_ms": embed + search,
        "non_overlapped_retrieval_ms": embed + non_overlapped,
        **extra,
    }


def test_the_search_time_leaves_out_the_embedding() -> None:
    assert search_ms(record(0, 300, 100, 20, 100)) == pytest.approx(100)


def test_overlap_fraction_is_the_share_of_the_gain_the_bound_allows() -> None:
    # Serial: embed 20 + search 100 + prefill 200 = 320; bound 20 + max(100, 200) = 220.
    serial = [record(i, 320, 100, 20, 100) for i in range(3)]
    reaching = [record(i, 220, 100, 20, 0) for i in range(3)]
    halfway = [record(i, 270, 100, 20, 50) for i in range(3)]
    full = overlap(serial, reaching)
    assert full["ratio"] == pytest.approx(0.5)
    assert full["bound_ttft_ms"] == pytest.approx(220)
    assert full["overlap_fraction"] == pytest.approx(1.0)
    assert full["non_overlapped_over_search"] == pytest.approx(0.0)
    assert overlap(serial, halfway)["overlap_fraction"] == pytest.approx(0.5)
    assert overlap(serial, serial)["overlap_fraction"] == pytest.approx(0.0)
    # Every query gained the same share: the interval is that share alone.
    assert full["overlap_fraction_ci"] == pytest.approx([1.0, 1.0])
    assert overlap(serial, halfway)["overlap_fraction_ci"] == pytest.approx([0.5, 0.5])


def test_the_overlap_interval_resamples_queries_and_keeps_each_querys_gains_paired() -> None:
    # Serial 320 ms and bound 220 ms for every query; half the queries reach the bound, half gain
    # nothing: the share is 0.5, and resampling 16 queries spreads it well inside [0, 1].
    serial = [record(i, 320, 100, 20, 100) for i in range(16)]
    mixed = [record(i, 220 if i % 2 else 320, 100, 20, 0 if i % 2 else 100) for i in range(16)]
    low, high = overlap(serial, mixed)["overlap_fraction_ci"]
    assert 0.1 < low < 0.5 < high < 0.9
    # A query twice as slow in serial (so twice the possible gain) that reaches its bound weighs
    # twice in the share, in every resample: pairing keeps the interval at the share when all reach it.
    slow = [record(i, 320 + 200 * (i % 2), 100 + 100 * (i % 2), 20, 100) for i in range(16)]
    reaching = [record(i, 220 + 100 * (i % 2), 100, 20, 0) for i in range(16)]
    assert overlap(slow, reaching)["overlap_fraction_ci"] == pytest.approx([1.0, 1.0])
    assert all(math.isnan(end) for end in share_ci(np.array([]), np.array([])))


def test_the_ideal_run_measures_the_gain_this_machine_allows() -> None:
    # Serial 320 ms, bound 220 ms; overlapped, the prefill took 240 ms beside the search: the
    # ideal run (final prompt from the search's start) answered at 260, so a configuration at 270
    # has half of the bound's gain and five sixths of the ideal's.
    serial = [record(i, 320, 100, 20, 100) for i in range(3)]
    halfway = [record(i, 270, 100, 20, 50) for i in range(3)]
    ideal = [{"i": i, "ttft_ms": 260.0} for i in range(3)]
    row = overlap(serial, halfway, ideal)
    assert row["overlap_fraction"] == pytest.approx(0.5)
    assert row["ideal_ttft_ms"] == pytest.approx(260)
    assert row["overlap_fraction_of_ideal"] == pytest.approx(50 / 60)
    assert row["loss_vs_ideal_ms"] == pytest.approx(10) and row["queries_with_stale_guesses"] == 0
    assert "ideal_ttft_ms" not in overlap(serial, halfway)
    # One query of three aborted a stale guess and lost 40 ms: 40 / 3 of the mean loss is its.
    stale = {"kind": "spec_abort", "reason": "stale"}
    mixed = [record(0, 300, 100, 20, 80, events=[stale]), *halfway[1:]]
    split = overlap(serial, mixed, ideal)
    assert split["queries_with_stale_guesses"] == 1
    assert split["loss_vs_ideal_ms"] == pytest.approx((40 + 10 + 10) / 3)
    assert split["loss_vs_ideal_from_stale_guesses_ms"] == pytest.approx(40 / 3)
    # Only queries the ideal run answered count, in both shares.
    assert overlap(serial, halfway, ideal[:1])["serial_ttft_ms"] == pytest.approx(320)


def test_overlap_pairs_queries_and_skips_failed_ones() -> None:
    serial = [record(0, 320, 100, 20, 100), record(1, 620, 100, 20, 100)]
    other = [record(0, 220, 100, 20, 0), {"i": 1, "error": "EngineError: gone"}]
    assert overlap(serial, other)["serial_ttft_ms"] == pytest.approx(320)


def test_points_are_chosen_by_predicted_ratio_and_unreachable_targets_share_one() -> None:
    search_ms = {0.25: 25.0, 0.5: 50.0, 1.0: 100.0}
    prefill_ms = {1: 100.0, 4: 200.0}
    assert nearest_point("ivf", search_ms, prefill_ms, 0.25).predicted_ratio == pytest.approx(0.25)
    one = nearest_point("ivf", search_ms, prefill_ms, 1.0)
    assert (one.knob, one.k) == (1.0, 1)
    # 2.0 is out of reach: it maps to the same point as 1.0 and runs once; 0.05 comes nearest at
    # the cheapest search with the longest prompt (0.125).
    points = sweep_points(search_ms, prefill_ms)
    assert len(points) == 4 and min(p.predicted_ratio for p in points) == pytest.approx(0.125)


def test_quick_keeps_the_quoted_points_and_their_queries_and_the_full_run_keeps_its_sweep() -> None:
    quick = parse_args(["--quick"])
    assert (quick.targets, quick.idle_queries, quick.loaded_queries) == ((0.05, 1.0), 16, 20)
    full = parse_args([])
    assert (full.targets, full.idle_queries, full.loaded_queries) == ((0.05, 0.25, 0.5, 1.0, 2.0), 32, 48)
    assert parse_args(["--quick", "--targets", "0.5"]).targets == (0.5,)


def test_waste_counts_against_everything_the_engine_prefilled() -> None:
    records = [
        record(0, 1, 1, 1, 0, prompt_tokens=100, cached_prompt_tokens=20, wasted_spec_prefill_tokens=20),
        record(1, 1, 1, 1, 0, prompt_tokens=100, cached_prompt_tokens=100, wasted_spec_prefill_tokens=0),
    ]
    assert wasted_share(records) == pytest.approx(20 / 100)


def test_saturation_is_set_by_the_busier_of_engine_and_search() -> None:
    engine_bound = [record(0, 300, 100, 20, 100, e2e_ms=520)]  # engine busy 400 ms
    assert saturation_rps(engine_bound) == pytest.approx(2.5)
    search_bound = [record(0, 700, 600, 20, 600, e2e_ms=720)]  # engine 100 ms, search 600 ms
    assert saturation_rps(search_bound) == pytest.approx(1 / 0.6)


def point(ratio: float, overlap_fraction: float) -> dict[str, Any]:
    """A point summary as point_summary writes it, with only the rows of ``all`` and
    ``all-always`` (the same but 30 ms slower) filled in."""
    row = {
        "ratio": ratio,
        "serial_ttft_ms": 300.0,
        "config_ttft_ms": 250.0,
        "bound_ttft_ms": 200.0,
        "overlap_fraction": overlap_fraction,
        "overlap_fraction_ci": [overlap_fraction - 0.1, overlap_fraction + 0.1],
        "non_overlapped_over_search": 0.1,
        "search_ms": 100.0,
    }
    always = {**row, "config_ttft_ms": 280.0}
    summaries = {
        "all": {"speculations": 8, "requests": 4, "errors": 0},
        "all-always": {"speculations": 12, "requests": 4, "errors": 0},
    }
    # Every phase's median: serial's 10 ms, all's its ratio (so that points can be told apart).
    phases = {
        name: {phase: {"mean": value, "median": value} for phase in PHASES}
        for name, value in (("serial", 10.0), ("all", ratio))
    }
    return {"configurations": {"all": row, "all-always": always}, "summaries": summaries, "phases": phases}


def test_the_headline_sorts_points_by_ratio_and_adds_the_extra_points() -> None:
    loaded = {
        **point(1.0, 0.9),
        "utilization": 0.7,
        "ttft_mean_over_serial": {"all": 0.8, "all-always": 0.85},
        "ttft_p99_over_serial": {"all": 0.9, "all-always": 1.1},
        "wasted_spec_prefill_share": {"all": 0.01, "all-always": 0.2},
    }
    facts = {"stages": {"ivf": 6, "hnsw": 5}, "pinning": "apart", "index": {"kind": "ivf-sq8"}}
    result = {
        "facts": facts,
        "idle": [point(2.0, 0.7), point(0.5, 0.95)],
        "loaded": loaded,
        "hnsw": point(1.1, 0.97),
        "ivf_flat": point(0.9, 0.6),
    }
    line = headline(result)
    assert "earliest_overlap_fraction" not in line["hnsw"]
    # An earliest run that gained 80 of serial's 300 ms: all's 50 ms gain is five eighths of it.
    earliest = {
        "earliest": {
            "serial_ttft_ms": 300.0,
            "config_ttft_ms": 220.0,
            "overlap_fraction": 0.8,
            "overlap_fraction_ci": [0.7, 0.9],
        }
    }
    with_bound = headline({**result, "hnsw": {**point(1.1, 0.97), "earliest": earliest}})["hnsw"]
    assert with_bound["earliest_overlap_fraction"] == 0.8
    assert with_bound["earliest_overlap_fraction_ci"] == [0.7, 0.9]
    assert line["hnsw"]["overlap_fraction_ci"] == pytest.approx([0.87, 1.07])
    assert line["idle"][0]["overlap_fraction_ci"] == pytest.approx([0.85, 1.05])
    assert with_bound["all_share_of_earliest"] == pytest.approx(50 / 80, abs=1e-3)
    assert [row["ratio"] for row in line["idle"]] == [0.5, 2.0]
    assert {key: line["ivf_flat"][key] for key in ("ratio", "overlap_fraction")} == {
        "ratio": 0.9,
        "overlap_fraction": 0.6,
    }
    assert line["ivf_flat"]["phases"]["all"]["submit_to_queued_ms"] == 0.9
    assert line["hnsw"]["overlap_fraction"] == 0.97 and line["index"]["kind"] == "ivf-sq8"
    assert line["loaded"]["ttft_p99_over_serial_all"] == 0.9
    assert line["loaded"]["wasted_spec_prefill_share_all_always"] == 0.2
    assert line["low_r"]["ratio"] == 0.5 and line["low_r"]["all_always_over_serial"] == pytest.approx(
        280 / 300, abs=1e-3
    )
    assert line["low_r"]["speculations_per_query"] == {"all": 2.0, "all-always": 3.0}
    assert "ivf_flat" not in headline({**result, "ivf_flat": None})
    assert "hnsw" not in headline({**result, "hnsw": None})  # --hnsw-size 0
    assert "pgvector" not in line  # a sweep without --pgvector-rows
    with_table = headline({**result, "pgvector": point(1.7, 0.82)})["pgvector"]
    assert (with_table["ratio"], with_table["overlap_fraction"]) == (1.7, 0.82)
    assert with_table["phases"]["all"]["submit_to_queued_ms"] == 1.7


def test_a_trace_splits_into_two_halves_numbered_as_in_the_whole_and_arriving_from_zero() -> None:
    trace = [TraceQuery(t=2.0 * i + 1.0, query=f"q{i}") for i in range(5)]
    (first, head), (second, tail) = halves(trace)
    assert (first, second) == (0, 2)
    assert [q.query for q in head + tail] == [q.query for q in trace]
    assert [q.t for q in head] == [0.0, 2.0] and [q.t for q in tail] == [0.0, 2.0, 4.0]
    assert halves(trace[:1]) == [(0, [TraceQuery(t=0.0, query="q0")])]


def test_an_hnsw_point_searches_hybrid_like_the_ivf_points() -> None:
    """with_ef_search retunes the graph's search and keeps the BM25 channel: HNSW and IVF points
    are searched the same way, and their summaries say which."""
    from specrag.retrieval.corpus import Passage
    from specrag.retrieval.index_store import IndexConfig, build_index

    passages = [Passage(f"p{n}", "t", f"passage {n} about topic {n % 7} and word{n}") for n in range(80)]
    index = build_index(passages, IndexConfig(kind="hnsw", ef_search=32))
    assert index.hybrid
    retuned = with_ef_search(index, 64)
    assert retuned.hybrid and retuned.lexical is index.lexical and retuned.fusion == index.fusion
    vector = index.embed_query("word5")
    assert list(retuned.search(vector, 3, query_text="word5")[1]) == list(
        index.search(vector, 3, query_text="word5")[1]
    )


def test_the_headline_guards_the_point_nearest_r_1_with_its_phases() -> None:
    result = {
        "facts": {"stages": {}, "pinning": "apart", "index": {}},
        "idle": [point(2.0, 0.7), point(0.8, 0.95), point(0.3, 0.9)],
        "loaded": {
            **point(1.0, 0.9),
            "utilization": 0.7,
            **{
                key: {"all": 1.0, "all-always": 1.0}
                for key in ("ttft_mean_over_serial", "ttft_p99_over_serial", "wasted_spec_prefill_share")
            },
        },
        "hnsw": None,
        "ivf_flat": None,
    }
    guard = headline(result)["near_r1"]
    assert guard["ratio"] == 0.8 and guard["overlap_fraction"] == 0.95
    assert guard["above_bound_ms"] == 50.0
    assert guard["above_bound_after_prefill_start_ms"] == 40.0  # 10 ms of it the non-overlapped search
    assert guard["phases"]["serial"]["queued_to_scheduled_ms"] == 10.0
    assert guard["phases"]["all"]["scheduled_to_engine_first_token_ms"] == 0.8


def test_phases_are_summarised_over_the_answers_that_report_them() -> None:
    def answer(i: int, queued_ms: float | None, adopted: bool, prefilling: int) -> dict[str, Any]:
        phases: dict[str, Any] = dict.fromkeys(PHASES, 1.0)
        phases.update(
            queued_to_scheduled_ms=queued_ms,
            beside_at_submit={"prefilling": prefilling, "decoding": 0, "engine_waiting": 0},
            aborted_before_submit=1 if adopted else 0,
        )
        return {**record(i, 100.0, 50.0, 1.0, 0.0), "adopted": adopted, "phases": phases}

    records = [answer(0, 2.0, True, 1), answer(1, 4.0, False, 0), answer(2, None, False, 0)]
    records.append({**record(3, 100.0, 50.0, 1.0, 0.0), "error": "timed out"})  # a failed query: left out
    summary = phase_summary(records)
    assert summary["queued_to_scheduled_ms"] == {"mean": 3.0, "median": 3.0}  # the unknown one is left out
    assert summary["answers"] == 3 and summary["adopted"] == 1
    assert summary["beside_prefilling_at_submit"] == 1 and summary["aborted_before_submit"] == 1


async def test_the_ideal_run_times_each_answered_query_s_prompt_beside_its_search(
    tiny_assets: Assets,
) -> None:
    """Each query serial answered: its prompt submitted as its search starts; the TTFT is serial's
    embedding plus the later of the two. A query serial did not answer is left out."""
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    index = scripted_index(tiny_assets, [A], 0.05)
    trace = [TraceQuery(0.0, "what is a list"), TraceQuery(1.0, "what is a dict")]
    serial = {5: {"embed_ms": 2.0}}
    records = await bound_records(engine, index, trace, 5, 4, serial, {5: (1, 2, 3) * 20, 6: (4, 5, 6)}, None)
    await engine.close()
    assert [r["i"] for r in records] == [5]
    record = records[0]
    assert record["search_ms"] >= 50  # the scripted search's one stage
    assert record["ttft_ms"] == pytest.approx(
        2.0 + max(record["search_ms"], record["prefill_beside_search_ms"])
    )


@pytest.mark.parametrize(
    ("stages", "expected_stage"),
    [([B, A, A], 2), ([A, B, A], 1), ([B, B, A], 3)],
    ids=["settles-at-2", "right-at-1-then-wrong", "only-the-last"],
)
async def test_the_earliest_run_submits_as_the_first_stage_holding_the_final_passages_ends(
    tiny_assets: Assets, stages: list[list[int]], expected_stage: int
) -> None:
    """The final prompt goes in at the end of the first stage whose top-k is the final one (even
    one a later stage undoes: no speculation could submit the right prompt earlier); the TTFT is
    serial's embedding plus the later of the search's end and the first token."""
    delay_s = 0.03
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    index = scripted_index(tiny_assets, stages, delay_s)
    trace = [TraceQuery(0.0, "what is a list"), TraceQuery(1.0, "what is a dict")]
    serial = {0: {"embed_ms": 2.0}, 1: {"embed_ms": 3.0}}
    records = await bound_records(
        engine, index, trace, 0, 4, serial, {0: (1, 2, 3) * 40, 1: (4, 5, 6) * 40}, index.stage_plan()
    )
    await engine.close()
    assert [r["stage"] for r in records] == [expected_stage] * 2
    for found in records:
        assert found["submitted_ms"] >= expected_stage * delay_s * 1000
        assert found["search_ms"] >= len(stages) * delay_s * 1000
        answer_ms = found["submitted_ms"] + found["prefill_beside_search_ms"]
        assert found["ttft_ms"] == pytest.approx(found["embed_ms"] + max(found["search_ms"], answer_ms))
        assert found["non_overlapped_retrieval_ms"] == pytest.approx(
            found["embed_ms"] + found["submitted_ms"]
        )
    summary = earliest_summary([record(r["i"], 500, 90, r["embed_ms"], 90) for r in records], records, [])
    assert summary["queries_by_stage"] == {str(expected_stage): 2}
    assert summary["submitted_ms"] == pytest.approx(sum(r["submitted_ms"] for r in records) / 2)
