"""The end-to-end experiment's parts: workloads, traces, replay on the real engine, the figures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.e2e.report import paired_ratio_ci, summarize
from bench.e2e.runner import Configuration, RunResult, oracle_ttfts, run_configuration
from bench.e2e.workload import arrivals, generate, load_trace, save_trace
from specrag.controller.controller import ControllerConfig
from specrag.errors import InvalidInputError
from specrag.pipeline.config import EngineConfig
from specrag.pipeline.prompt import PromptBuilder
from specrag.pipeline.vllm_engine import VllmEngine
from specrag.retrieval.corpus import Passage
from specrag.service.assets import Assets


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
    return {"i": i, "ttft_ms": ttft}


def test_paired_ratio_and_interval() -> None:
    baseline = [_record(i, 100.0 + i) for i in range(50)]
    faster = [_record(i, (100.0 + i) * 0.5) for i in range(50)]
    ratio, low, high = paired_ratio_ci(baseline, faster)
    assert ratio == pytest.approx(0.5) and low == pytest.approx(0.5) and high == pytest.approx(0.5)
    noisy = [_record(i, (100.0 + i) * (0.5 if i % 2 else 1.5)) for i in range(50)]
    ratio, low, high = paired_ratio_ci(baseline, noisy)
    assert low < ratio < high


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
    oracle = await oracle_ttfts(vllm_engine, run.prompts)
    summary = summarize(run, {i: v * 1000 for i, v in oracle.items()}, slo_ms=10_000)
    assert summary["requests"] == 4 and summary["errors"] == 0
    assert 0 < summary["cached_token_ratio"] <= 1
    assert summary["goodput_rps_at_slo"] > 0
    assert summary["fraction_of_oracle_ttft"] is not None and summary["fraction_of_oracle_ttft"] > 0
