"""bench.scale's replay: conversations continue their history, a dead replica costs no query."""

from __future__ import annotations

import asyncio

from bench.scale.routers import (
    SIM_SYSTEM,
    Replay,
    Sample,
    parse_args,
    real_replay,
    replay_trace,
    reuse_bound,
    simulated,
    simulated_replay,
    simulated_results,
    summary,
    synthetic_document,
    synthetic_question,
    traces,
)
from bench.traces import TraceRequest
from specrag.controller.placement import ROUTERS, Placement
from specrag.controller.replicas import Replica
from specrag.pipeline.engines.protocol import Sampling
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.service.run.assets import Assets
from specrag.sim import virtual_time
from specrag.sim.engine import SimulatedEngine
from specrag.sim.replicas import simulated_replica
from tests.helpers.waiting import wait_until


def pool(n: int) -> list[Replica]:
    return [simulated_replica(f"r{i}", SIM_SYSTEM, time_scale=0.01, max_model_len=32768) for i in range(n)]


def replay() -> Replay:
    return Replay(SIM_SYSTEM, synthetic_document, synthetic_question, Sampling(max_tokens=4))


async def test_a_later_turn_continues_its_history_on_the_replica_that_holds_it() -> None:
    replicas = pool(3)
    trace = [TraceRequest(0, (1, 2, 3), "c"), TraceRequest(1, (3, 4), "c")]
    samples = await replay_trace(Placement(replicas), trace, [0.0, 0.0], replay())
    first, second = samples
    assert second.replica == first.replica
    # The whole first prompt and its answer are a prefix of the second (document 3 is not repeated).
    assert second.cached_tokens >= first.prompt_tokens // 32 * 32
    assert summary(samples)["cached_token_share"] > 0
    for replica in replicas:
        await replica.engine.close()


async def test_a_later_turn_leaves_the_trees_first_turn_paths_alone() -> None:
    """Document 4 first comes after a history; a first turn starting with it must not be told the
    blocks it had there (they follow the history, so no other prompt can reuse them)."""
    replicas = pool(1)
    trace = [TraceRequest(0, (1, 2), "c"), TraceRequest(1, (2, 4), "c")]
    samples = await replay_trace(Placement(replicas), trace, [0.0, 0.0], replay())
    assert samples[1].cached_tokens > len(SIM_SYSTEM)  # the history was reused
    assert replicas[0].tree.cached_prefix((4,)).tokens == len(SIM_SYSTEM)
    await replicas[0].engine.close()


def test_a_request_placed_while_an_earlier_one_prefills_takes_its_order_and_its_computed_blocks() -> None:
    """The earlier prompt's path is pending on its replica from its submission: the later one,
    over the same documents in another retrieval order, follows it and reuses the blocks its
    prefill has stored so far (the engine fixes a request's hit when it schedules it)."""

    async def run() -> tuple[list[Sample], Replica]:
        replica = simulated_replica("r0", SIM_SYSTEM, max_model_len=32768)
        trace = [TraceRequest(0, (1, 2, 3)), TraceRequest(1, (3, 2, 1))]
        samples = await replay_trace(Placement([replica]), trace, [0.0, 0.15], replay())
        await replica.engine.close()
        return samples, replica

    (first, second), replica = virtual_time.run(run())
    assert first.ttft_s is not None and first.ttft_s > 0.15  # the second came before its first token
    assert list(replica.tree.root.children) == [1]  # one order for both
    assert second.cached_tokens > len(SIM_SYSTEM)  # document 1's blocks, not only the system prompt


def padded(doc_id: int) -> int:
    return -(-len(synthetic_document(doc_id)) // 32) * 32


def test_the_reuse_bound_counts_what_earlier_prompts_computed_before_a_later_one_arrived() -> None:
    trace = [TraceRequest(0, (1, 2)), TraceRequest(1, (2, 1))]
    documents_end = len(SIM_SYSTEM) + padded(1) + padded(2)  # the system prompt is 5 whole blocks
    cached, prompt = reuse_bound(trace, replay())
    assert prompt == 2 * (documents_end + len(synthetic_question(0)))
    # Each waited for the one before: the second takes the first's order and reuses its documents.
    assert cached == len(SIM_SYSTEM) + documents_end
    assert reuse_bound(trace, replay(), [0.0, 10.0]) == (cached, prompt)  # long done when it came
    assert reuse_bound(trace, replay(), [0.0, 0.0]) == (2 * len(SIM_SYSTEM), prompt)  # nothing yet


def test_the_reuse_bound_lets_a_later_turn_reuse_its_whole_history() -> None:
    trace = [TraceRequest(0, (1, 2), "c"), TraceRequest(1, (2, 3), "c")]
    first = len(SIM_SYSTEM) + padded(1) + padded(2) + len(synthetic_question(0))
    history = first + replay().sampling.max_tokens
    cached, prompt = reuse_bound(trace, replay())
    assert cached == len(SIM_SYSTEM) + history // 32 * 32
    assert prompt == first + -(-history // 32) * 32 + padded(3) + len(synthetic_question(1))


def test_the_reuse_bound_is_over_the_prompts_the_routers_were_sent() -> None:
    by_router = virtual_time.run(simulated(12, 5.0, 0))
    for name, trace in traces(12, 0).items():
        sent = {sum(s.prompt_tokens for s in runs[name]) for runs in by_router.values()}
        assert sent == {reuse_bound(trace, simulated_replay())[1]}


def test_the_simulation_runs_in_virtual_time_and_repeats_itself() -> None:
    """The same seed gives the same figures, and however long the routers compute, TTFTs are
    simulated (a 1 s idle gap in the trace costs no wall time)."""
    args = parse_args(["--queries", "12", "--no-real"])
    first, second = simulated_results(args), simulated_results(args)
    assert first["simulated"] == second["simulated"]
    assert set(first["router_cpu_ms"]) == set(ROUTERS)
    assert all(summary["ttft_mean_ms"] > 0 for summary in first["simulated"].values())


async def test_queries_waiting_on_a_dead_replica_are_retried_on_another() -> None:
    replicas = pool(2)
    trace = [TraceRequest(i, (10 * i, 10 * i + 1)) for i in range(6)]
    running = asyncio.create_task(replay_trace(Placement(replicas), trace, [0.0] * 6, replay()))
    await wait_until(lambda: replicas[0].pending > 0, within_s=5, every_s=0.001)
    engine = replicas[0].engine
    assert isinstance(engine, SimulatedEngine)
    await engine.die()
    samples = await asyncio.wait_for(running, 10)
    assert all(sample.first_token_at is not None for sample in samples)
    assert any(sample.retried_from == "r0" and sample.replica == "r1" for sample in samples)
    await replicas[1].engine.close()


def test_the_real_replay_starts_with_the_system_prompt_as_the_trees_hold_it(tiny_assets: Assets) -> None:
    builder = PromptBuilder(tiny_assets.tokenizer, tiny_assets.store, block_size=32)
    replay = real_replay(builder, tiny_assets, seed=0)
    # Already padded (with the tokenizer's pad token), so the replay's own layout adds no padding
    # of another token: a tree built from the builder's system layout accepts its prompts.
    assert tuple(replay.system) == builder.system_layout_tokens()
    assert len(replay.system) % 32 == 0
