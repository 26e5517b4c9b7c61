"""The router: one exact tree per replica, the document order chosen per replica, faults.

Each replica is a simulated engine whose KV events feed its own tree, as vLLM's feed a real one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from specrag.cache.layout import DocId, PromptLayout
from specrag.cache.ordering import Ordering, get_policy
from specrag.cache.tree import KnowledgeTree
from specrag.controller.placement import ROUTERS, Placement, PlacementMemo, health_checks
from specrag.controller.replicas import Replica
from specrag.errors import EngineError, EngineUnavailableError, InvalidInputError
from specrag.sim.engine import SimulatedEngine
from specrag.sim.replicas import simulated_replica
from tests.helpers.engines import run_prompt
from tests.helpers.tree import BLOCK, SYSTEM, layout
from tests.helpers.waiting import wait_until

EXACT = get_policy("exact")


def replicas(n: int) -> list[Replica]:
    return [simulated_replica(f"r{i}", SYSTEM, block_size=BLOCK, time_scale=0.0) for i in range(n)]


async def serve(replica: Replica, order: list[int]) -> None:
    """Run a prompt on the replica; its events reach its tree, which also learns the path."""
    prompt = layout(order)
    await run_prompt(replica.engine, prompt.token_ids)
    replica.tree.record_served(prompt)


async def close(pool: list[Replica]) -> None:
    for replica in pool:
        await replica.engine.close()


def hold(replica: Replica, n: int) -> list[EngineError]:
    """Make ``n`` short requests of ours pending on the replica; returns the errors they fail with."""
    failures: list[EngineError] = []
    for _ in range(n):
        replica.submitted(f"held-{replica.name}-{replica.pending}", 0, 2, failures.append)
    return failures


async def test_joint_routing_picks_the_replica_and_the_order_that_reuse_the_most() -> None:
    pool = replicas(3)
    await serve(pool[1], [1, 2, 3])
    await serve(pool[2], [4, 5])
    placement = Placement(pool)
    placed = placement.place_documents(EXACT, [3, 7, 1, 2], layout)
    assert placed.replica is pool[1]
    assert placed.layout.document_ids()[:3] == (1, 2, 3)
    assert placed.predicted_cached == pool[1].tree.cached_prefix((1, 2, 3)).tokens > 0
    assert placed.reason == "lowest estimated TTFT" and placed.estimate_s > 0
    # The same exact trees with the documents in retrieval order: no replica holds "3, 7, ...".
    fixed = Placement(pool, router="exact_retrieval_order").place_documents(EXACT, [3, 7, 1, 2], layout)
    assert fixed.layout.document_ids() == (3, 7, 1, 2)
    assert fixed.predicted_cached < placed.predicted_cached
    await close(pool)


async def test_the_imbalance_bound_keeps_a_hot_prefix_from_piling_onto_one_replica() -> None:
    pool = replicas(2)
    await serve(pool[0], [1, 2, 3])
    placement = Placement(pool, imbalance_bound=1)
    hold(pool[0], 1)
    assert placement.place_documents(EXACT, [1, 2, 3], layout).replica is pool[0]
    hold(pool[0], 1)  # two pending against none: beyond the bound
    assert placement.place_documents(EXACT, [1, 2, 3], layout).replica is pool[1]
    await close(pool)


async def test_a_fixed_prompt_goes_to_the_replica_holding_its_prefix() -> None:
    pool = replicas(2)
    history = layout([5, 6, 7])
    await run_prompt(pool[1].engine, history.token_ids)
    turn = layout([5, 6, 7, 8])  # the conversation so far, then new documents
    placed = Placement(pool).place_prompt(turn)
    assert placed.replica is pool[1] and placed.layout is turn
    assert placed.predicted_cached == pool[1].tree.cached_tokens(turn.token_ids) > 0
    await close(pool)


async def test_baseline_routers() -> None:
    pool = replicas(3)
    round_robin = Placement(pool, router="round_robin")
    assert [round_robin.place_documents(EXACT, [1], layout).replica.name for _ in range(4)] == [
        "r0",
        "r1",
        "r2",
        "r0",
    ]
    hold(pool[0], 2)
    hold(pool[1], 1)
    least = Placement(pool, router="least_loaded").place_documents(EXACT, [1, 2], layout)
    assert least.replica is pool[2] and least.layout.document_ids() == (1, 2)
    approx = Placement(pool, router="approx_prefix", imbalance_bound=1)
    first = approx.place_documents(EXACT, [4, 5, 6], layout)
    assert first.replica is pool[2] and first.reason == "least loaded"
    hold(pool[2], 1)  # the replica it remembers is now one ahead: within the bound
    again = approx.place_documents(EXACT, [4, 5, 6], layout)
    assert again.replica is pool[2] and again.reason == "longest routed prefix"
    await close(pool)


async def test_an_excluded_replica_fails_its_waiting_requests_and_forgets_its_cache() -> None:
    pool = replicas(2)
    await serve(pool[0], [1, 2, 3])
    failures = hold(pool[0], 2)
    placement = Placement(pool)
    placement.report_failure(pool[0], "engine died")
    assert pool[0].excluded == "engine died" and pool[0].pending == 0
    assert len(failures) == 2 and all("excluded" in str(error) for error in failures)
    assert not pool[0].tree.system_prompt_resident()
    assert placement.place_documents(EXACT, [1, 2, 3], layout).replica is pool[1]
    placement.report_failure(pool[1], "engine died")
    with pytest.raises(EngineUnavailableError, match="no engine replica is available"):
        placement.place_documents(EXACT, [1], layout)
    await close(pool)


async def test_a_replica_rejoins_once_it_answers_and_a_dead_one_stays_out() -> None:
    pool = replicas(2)
    placement = Placement(pool)
    for replica in pool:
        placement.report_failure(replica, "no first token in time")
    await pool[1].engine.close()
    async with health_checks(placement, every_s=0.01):
        await wait_until(lambda: pool[0].excluded is None, within_s=5)
        await asyncio.sleep(0.05)
    assert pool[1].excluded is not None
    assert placement.place_documents(EXACT, [1], layout).replica is pool[0]
    await close(pool)


async def test_with_one_replica_a_failure_does_not_exclude_it() -> None:
    pool = replicas(1)
    placement = Placement(pool)
    placement.report_failure(pool[0], "no first token in time")
    assert pool[0].available
    assert placement.place_documents(EXACT, [1], layout).reason == "only replica"
    await close(pool)


def test_the_speed_factor_follows_observed_first_tokens() -> None:
    replica = replicas(1)[0]
    replica.submitted("slow", 0, 4000, lambda error: None)
    predicted = replica.ttft_s(0, 0) + replica.prefill_s(0, 4000)
    replica.first_token("slow", replica._pending["slow"].submitted_at + 3 * predicted)
    assert replica.speed > 1.0 and replica.pending == 0


def test_bad_placements_are_refused() -> None:
    pool = replicas(2)
    with pytest.raises(InvalidInputError, match="unknown router"):
        Placement(pool, router="random")
    with pytest.raises(InvalidInputError, match="at least one replica"):
        Placement([])
    with pytest.raises(InvalidInputError, match="distinct"):
        Placement([pool[0], pool[0]])
    with pytest.raises(InvalidInputError, match="imbalance_bound"):
        Placement(pool, imbalance_bound=-1)
    other = SimulatedEngine(block_size=8)
    with pytest.raises(InvalidInputError, match="block size"):
        Replica("x", other, KnowledgeTree(SYSTEM, block_size=BLOCK))
    assert set(ROUTERS) >= {"specrag", "round_robin"}


class _Counting:
    """``exact``, counting the orders it makes."""

    name = "exact"

    def __init__(self) -> None:
        self.calls = 0

    def order(self, tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> Ordering:
        self.calls += 1
        return EXACT.order(tree, doc_ids)


async def test_a_query_memo_orders_again_only_once_a_tree_changed() -> None:
    pool = replicas(2)
    placement, memo, policy = Placement(pool), PlacementMemo(), _Counting()
    built: list[tuple[DocId, ...]] = []

    def build(order: Sequence[DocId]) -> PromptLayout:
        built.append(tuple(order))
        return layout(order)

    first = placement.place_documents(policy, [4, 5], build, memo=memo)
    again = placement.place_documents(policy, [4, 5], build, memo=memo)
    assert policy.calls == 2 and built == [(4, 5)]  # one order per replica, one prompt for both
    assert again.layout is first.layout and again.replica is first.replica
    await serve(pool[0], [5, 4])  # replica 0 now holds "5, 4": its order changes, replica 1's not
    changed = placement.place_documents(policy, [4, 5], build, memo=memo)
    assert policy.calls == 3 and built == [(4, 5), (5, 4)]
    assert changed.replica is pool[0] and changed.layout.document_ids() == (5, 4)
    await close(pool)


async def test_a_query_memo_predicts_again_once_the_blocks_changed() -> None:
    pool = replicas(1)
    placement, memo = Placement(pool), PlacementMemo()
    first = placement.place_documents(EXACT, [4, 5], layout, memo=memo)
    await serve(pool[0], [4, 5])  # the same order, now cached
    again = placement.place_documents(EXACT, [4, 5], layout, memo=memo)
    assert again.layout is first.layout
    assert again.predicted_cached == pool[0].tree.prompt_hit(again.layout) > first.predicted_cached
    await close(pool)
