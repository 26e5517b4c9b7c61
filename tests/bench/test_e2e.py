"""The end-to-end experiment's parts: workloads, traces, replay on the real engine, the figures."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from bench.e2e.options import parse_args
from bench.e2e.plan import SERIAL_REPEAT, configurations, run_order
from bench.e2e.report import paired_ratio_ci, summarize
from bench.e2e.runner import Configuration, RunResult, oracle_ttfts, run_configuration
from bench.e2e.workload import arrivals, generate, load_trace, save_trace
from specrag.controller.controller import ControllerConfig
from specrag.errors import InvalidInputError
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.corpus import Passage
from specrag.service.run.assets import Assets


@pytest.mark.parametrize("workload", ["zipf", "bursty", "multiturn"])
def test_workloads_are_deterministic_queries_from_the_corpus(
    default_corpus: list[Passage], workload: str
) -> None:
    first = generate(default_corpus, workload, 30, rate=2.0, seed=3)
    assert first == generate(default_corpus, workload, 30, rate=2.0, seed=3)
    assert first != generate(default_corpus, workload, 30, rate=2.0, seed=4)
    texts = {p.text for p in default_corpus}
    assert all(any(q.query in text for text in texts) for q in first[:5])
    assert [q.t for q in first] == sorted(q.t for q in first)
    sessions = [q.session for q in first]
    assert (workload == "multiturn") == all(s is not None for s in sessions)


def test_arrival_rate_and_burstiness() -> None:
    rng = np.random.default_rng(0)
    poisson = np.diff(arrivals(20_000, rate=4.0, cv=1.0, rng=rng))
    bursty = np.diff(arrivals(20_000, rate=4.0, cv=3.0, rng=rng))
    assert 1 / poisson.mean() == pytest.approx(4.0, rel=0.05)
    assert 1 / bursty.mean() == pytest.approx(4.0, rel=0.1)
    assert bursty.std() / bursty.mean() > 2 * poisson.std() / poisson.mean()
    with pytest.raises(InvalidInputError):
        arrivals(3, rate=0, cv=1, rng=rng)


def test_trace_round_trip_and_malformed_lines(tmp_path: Path, default_corpus: list[Passage]) -> None:
    trace = generate(default_corpus, "multiturn", 7, rate=1.0)
    path = tmp_path / "t.jsonl"
    save_trace(path, trace)
    assert load_trace(path) == trace
    path.write_text('{"t": 0, "query": "a"}\n{"query": "no time"}\n')
    with pytest.raises(InvalidInputError, match=r"t\.jsonl:2"):
        load_trace(path)


def _record(i: int, ttft: float) -> dict[str, object]:
    return {"i": (0, i), "ttft_ms": ttft}


def test_paired_ratio_and_interval() -> None:
    baseline = [_record(i, 100.0 + i) for i in range(50)]
    faster = [_record(i, (100.0 + i) * 0.5) for i in range(50)]
    ratio, low, high = paired_ratio_ci(baseline, faster)
    assert ratio == pytest.approx(0.5) and low == pytest.approx(0.5) and high == pytest.approx(0.5)
    noisy = [_record(i, (100.0 + i) * (0.5 if i % 2 else 1.5)) for i in range(50)]
    ratio, low, high = paired_ratio_ci(baseline, noisy)
    assert low < ratio < high


def test_the_interval_resamples_blocks_of_consecutive_requests_not_single_ones() -> None:
    baseline = [_record(i, 100.0) for i in range(48)]
    # Alternating inside every block: each block's sum is the same, so blocks agree exactly,
    # while single requests scatter; a per-request bootstrap would give a wide interval.
    alternating = [_record(i, 50.0 if i % 2 else 150.0) for i in range(48)]
    ratio, low, high = paired_ratio_ci(baseline, alternating)
    assert ratio == pytest.approx(1.0) and low == pytest.approx(1.0) and high == pytest.approx(1.0)


def test_failed_requests_are_counted_not_dropped() -> None:
    records = [
        {**_record(0, 100.0), "i": 0, "documents": ["a"], "cached_prompt_tokens": 0},
        {"i": 1, "error": "EngineError: gone"},
    ]
    ok = records[0]
    ok.update(prompt_tokens=10, predicted_cached_tokens=0, e2e_ms=120.0, wasted_spec_prefill_tokens=0)
    ok.update(speculations=0, adopted=False, warmed=False, controller_ms=1.0, aborted_speculations=0)
    run = RunResult(Configuration("serial", "serial", "main", 0.5), records, 1.0, 8, {}, True, 32)
    summary = summarize(run, {}, slo_ms=1000)
    assert summary["requests"] == 2 and summary["errors"] == 1
    assert summary["error_kinds"] == {"EngineError": 1}
    assert summary["reset_confirmed"] is True and summary["first_request_cold"] is True


def test_traces_run_the_main_configurations_in_counterbalanced_orders() -> None:
    main = [Configuration(mode, mode, "main", 0.5) for mode in ("serial", "warmup", "all")]
    extra = [Configuration("all-mpbs2", "all", "max_prefill_bs", 0.5)]
    plan = run_order(main + extra, traces=4)
    orders = [[c.name for seed, c in plan if seed == s] for s in range(4)]
    assert orders[0] == ["serial", "warmup", "all", "all-mpbs2"]
    assert orders[1] == ["all", "warmup", "serial"]  # backwards: steady drift cancels over the pair
    assert orders[2] == ["warmup", "all", "serial"]  # the next pair starts one place further on
    assert orders[3] == ["serial", "all", "warmup"]
    for pair in (orders[0][:3], orders[1]), (orders[2], orders[3]):
        places = {name: sum(order.index(name) for order in pair) for name in ("serial", "warmup", "all")}
        assert len(set(places.values())) == 1


def test_serial_runs_again_after_the_other_main_configurations() -> None:
    main = [c for c in configurations(argparse.Namespace(quick=True, ratio=0.5)) if c.group == "main"]
    assert main[0].name == "serial" and main[-1].name == SERIAL_REPEAT
    assert main[-1].mode == "serial" and not main[-1].overrides
    assert [c.name for c in main].count(SERIAL_REPEAT) == 1


def test_quick_runs_the_headline_comparison_only_and_the_full_run_keeps_its_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("sys.argv", ["bench.e2e", "--quick"])
    quick = parse_args()
    assert (quick.requests, quick.seeds, quick.index_size) == (8, 2, 1_000_000)
    assert [c.name for c in configurations(quick)] == ["serial", "all", SERIAL_REPEAT]
    monkeypatch.setattr("sys.argv", ["bench.e2e"])
    full = parse_args()
    assert (full.requests, full.seeds, full.index_size) == (32, 2, 2_000_000)
    groups = [c.group for c in configurations(full)]
    counts = {group: groups.count(group) for group in groups}
    assert counts == {"main": 8, "ordering": 3, "max_prefill_bs": 3, "stages": 2, "ratio": 6}


@pytest.mark.engine
async def test_a_configuration_replays_a_trace_on_the_real_engine(
    vllm_engine: VllmEngine, tiny_assets: Assets, tiny_engine_config: EngineConfig
) -> None:
    trace = generate(tiny_assets.passages, "bursty", 4, rate=20.0, seed=1)
    builder = PromptBuilder(tiny_assets.tokenizer, tiny_assets.store, block_size=vllm_engine.block_size)
    configuration = Configuration("all", "all", "main", 0.5)
    run = await run_configuration(
        vllm_engine,
        tiny_engine_config.kv_event_source(),
        tiny_assets.index,
        builder,
        ControllerConfig(),
        configuration,
        trace,
        3,
        2,
    )
    assert isinstance(run, RunResult) and len(run.records) == 4
    assert all("error" not in r and r["ttft_ms"] > 0 for r in run.records)
    assert run.reset_confirmed  # the engine itself found the system prompt gone after the reset
    for r in run.records:
        assert r["cached_prompt_tokens"] <= r["prompt_tokens"]
        assert r["non_overlapped_basis"] == "engine_scheduled"
        assert r["non_overlapped_retrieval_submitted_ms"] <= r["non_overlapped_retrieval_ms"]
        assert r["non_overlapped_retrieval_ms"] <= r["retrieval_ms"]
        assert 0 < r["embed_ms"] < r["retrieval_ms"]
        assert r["aborted_speculations"] <= r["speculations"]
        assert not r["adopted"] or r["speculations"] >= 1
        assert 1 <= len(r["documents"]) <= 3
    oracle = await oracle_ttfts(vllm_engine, run.prompts)
    summary = summarize(run, {i: v * 1000 for i, v in oracle.items()}, slo_ms=10_000)
    assert summary["requests"] == 4 and summary["errors"] == 0
    assert 0 < summary["cached_token_ratio"] <= 1
    assert summary["adopted_fraction"] * 4 <= summary["speculations"]
    assert summary["first_request_cold"] in (True, None)
    assert summary["goodput_rps_at_slo"] > 0
    assert summary["fraction_of_oracle_ttft"] is not None and summary["fraction_of_oracle_ttft"] > 0
