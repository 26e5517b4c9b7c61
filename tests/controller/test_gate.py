"""The prefill gate: the pool, the speculation budget, the engine's backlog, preemption."""

from __future__ import annotations

import asyncio

import pytest

from specrag.controller.gate import OrderingWindow, PrefillGate
from specrag.errors import EngineTimeoutError, InvalidInputError
from tests.helpers.tree import served_tree


def test_speculation_uses_only_an_idle_pool() -> None:
    gate = PrefillGate(max_prefill_bs=2, starvation_window_s=1.0)
    first = gate.try_speculate(compute_tokens=100)
    second = gate.try_speculate(compute_tokens=100)
    assert first is not None and second is not None
    assert gate.try_speculate(compute_tokens=100) is None  # the pool is full
    first.release()
    first.release()  # idempotent
    assert gate.pool == 1


def test_speculation_waits_while_the_engine_has_a_backlog() -> None:
    gate = PrefillGate(max_prefill_bs=4, starvation_window_s=1.0)
    assert gate.try_speculate(compute_tokens=10, engine_waiting=1) is None
    assert gate.pool == 0
    assert gate.try_speculate(compute_tokens=10, engine_waiting=0) is not None


def test_the_budget_caps_speculative_work_in_flight_but_always_allows_one() -> None:
    gate = PrefillGate(max_prefill_bs=8, starvation_window_s=1.0, speculative_token_budget=500)
    big = gate.try_speculate(compute_tokens=1200)  # over the budget alone: one may always run
    assert big is not None
    assert gate.try_speculate(compute_tokens=10) is None  # nothing more while it prefills
    big.release()
    small = [gate.try_speculate(compute_tokens=200) for _ in range(3)]
    assert [slot is not None for slot in small] == [True, True, False]
    assert gate.speculative_tokens == 400


async def test_a_final_request_preempts_the_newest_speculation() -> None:
    gate = PrefillGate(max_prefill_bs=2, starvation_window_s=1.0)
    preempted: list[str] = []
    old = gate.try_speculate(compute_tokens=100, preempt=lambda: preempted.append("old"))
    new = gate.try_speculate(compute_tokens=100, preempt=lambda: preempted.append("new"))
    assert old is not None and new is not None
    final = await asyncio.wait_for(gate.admit(cached_tokens=0, compute_tokens=100), 1.0)
    assert preempted == ["new"]
    assert not new.held and old.held and final.held
    assert gate.pool == 2 and gate.preemptions == 1
    assert gate.speculative_tokens == 100


async def test_final_requests_are_never_preempted_and_wait_their_turn() -> None:
    gate = PrefillGate(max_prefill_bs=1, starvation_window_s=1.0)
    first = await gate.admit(cached_tokens=0, compute_tokens=100)
    second = asyncio.create_task(gate.admit(cached_tokens=0, compute_tokens=100))
    await asyncio.sleep(0)
    assert not second.done() and gate.waiting == 1 and gate.preemptions == 0
    assert gate.try_speculate(compute_tokens=1) is None  # a final request waits: no speculation
    first.release()
    assert (await asyncio.wait_for(second, 1.0)).held


async def test_a_speculation_without_a_preempt_callback_is_waited_for() -> None:
    gate = PrefillGate(max_prefill_bs=1, starvation_window_s=1.0)
    warm_up = gate.try_speculate()
    assert warm_up is not None
    final = asyncio.create_task(gate.admit(cached_tokens=0, compute_tokens=100))
    await asyncio.sleep(0)
    assert not final.done() and warm_up.held
    warm_up.release()
    assert (await asyncio.wait_for(final, 1.0)).held


def test_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="max_prefill_bs"):
        PrefillGate(0, 1.0)
    with pytest.raises(InvalidInputError, match="speculative_token_budget"):
        PrefillGate(1, 1.0, speculative_token_budget=0)


async def test_the_window_order_picks_the_request_and_its_document_order_when_a_slot_frees() -> None:
    tree, _ = served_tree((1, 2, 3))
    gate = PrefillGate(max_prefill_bs=1, starvation_window_s=10.0, window=OrderingWindow(tree, 4))
    held = await gate.admit(cached_tokens=0, compute_tokens=100)
    cold = asyncio.create_task(gate.admit(0, 200, documents=(7, 8)))
    warm = asyncio.create_task(gate.admit(0, 200, documents=(3, 9, 1, 2)))
    await asyncio.sleep(0)
    held.release()
    granted = await asyncio.wait_for(warm, 1.0)  # the later request, because the tree holds its prefix
    assert not cold.done()
    assert granted.ordering is not None and granted.ordering.doc_ids[:3] == (1, 2, 3)
    granted.release()
    assert (await asyncio.wait_for(cold, 1.0)).ordering is not None


async def test_a_cancelled_waiter_leaves_the_window() -> None:
    tree, _ = served_tree((1, 2, 3))
    gate = PrefillGate(max_prefill_bs=1, starvation_window_s=10.0, window=OrderingWindow(tree, 4))
    held = await gate.admit(cached_tokens=0, compute_tokens=100)
    leaving = asyncio.create_task(gate.admit(0, 200, documents=(1, 2, 3)))
    staying = asyncio.create_task(gate.admit(0, 200, documents=(7, 8)))
    await asyncio.sleep(0)
    leaving.cancel()
    await asyncio.sleep(0)
    assert gate.waiting == 1
    held.release()
    assert (await asyncio.wait_for(staying, 1.0)).held and gate.pool == 1


async def test_a_cancelled_waiter_is_no_longer_counted_as_waiting() -> None:
    # The service refuses a final request (429) while `waiting` reaches max_queue: a caller who
    # left must not keep its place in that count until a slot happens to free.
    gate = PrefillGate(max_prefill_bs=1, starvation_window_s=10.0)
    held = await gate.admit(cached_tokens=0, compute_tokens=100)
    leaving = asyncio.create_task(gate.admit(0, 200))
    staying = asyncio.create_task(gate.admit(0, 100))
    await asyncio.sleep(0)
    leaving.cancel()
    await asyncio.sleep(0)
    assert gate.waiting == 1
    held.release()
    assert (await asyncio.wait_for(staying, 1.0)).held and (gate.pool, gate.waiting) == (1, 0)


async def test_a_wait_for_a_slot_that_never_comes_back_ends_with_an_error() -> None:
    # Should a slot ever leak, callers must get an error naming the pool within the bound, not
    # wait until their clients give up; the one who timed out no longer counts as waiting.
    gate = PrefillGate(max_prefill_bs=1, starvation_window_s=10.0, max_wait_s=0.05)
    held = await gate.admit(cached_tokens=0, compute_tokens=100)
    with pytest.raises(EngineTimeoutError, match=r"no prefill slot within 0\.1 s: the pool of 1 is full"):
        await asyncio.wait_for(gate.admit(0, 200), 5.0)
    assert (gate.pool, gate.waiting) == (1, 0)
    held.release()
    assert (await gate.admit(0, 100)).held
