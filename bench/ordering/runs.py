"""bench.ordering's measurement: every policy run on every trace, through the simulated engine."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

from bench.common import machine
from bench.ordering.oracle import MyopicOracleOrder
from bench.ordering.replay import Admission, Window, arrival_times, replay, saturating_rate
from bench.ordering.session_dedup import SessionDeduplicator
from bench.ordering.simulation import (
    BLOCK_SIZE,
    RunResult,
    Server,
    cached_docs,
    doc_tokens,
    prompt_tokens,
)
from bench.ordering.topic_traces import topic_cluster_trace
from bench.traces import TraceRequest, bursty_trace, multiturn_trace, read_trace, zipf_trace
from specrag.atomic import atomic_write_text
from specrag.cache import POLICY_NAMES, PrefillProfile, get_policy, plan_batch

LRU_FRACTION = 0.10
# ``batch`` runs the trace in its planned order; ``batch-arrival`` keeps the arrival order and
# takes only the batch plan's document orders, so it compares context ordering with the online
# policies on equal terms (an online server cannot reorder requests that have not arrived).
BATCH_POLICIES = ("batch", "batch-arrival")
# replayed at arrival times through one prefill slot: the window scheduler, and RAGCache's
# cached/compute queue for comparison (first come, first served is ``exact`` itself)
REPLAY_POLICIES: dict[str, Admission] = {"window": "window", "ratio-queue": "ratio"}
# Replays without arrival times (or a --rate) arrive at 1.2 times the rate one slot serves cold
# prompts: with reuse the slot is busy ~90 % of the time, so queues form and drain, which is when
# the order of waiting requests matters.
REPLAY_LOAD = 1.2
BENCH_POLICIES = (*POLICY_NAMES, "myopic-oracle", *BATCH_POLICIES, *REPLAY_POLICIES)
Cache = Literal["unlimited", "lru10"]
CACHES: tuple[Cache, ...] = ("unlimited", "lru10")


def synthesise_documents(trace: Sequence[TraceRequest]) -> None:
    """Make every document's tokens before anything is timed."""
    for request in trace:
        for doc_id in request.docs:
            doc_tokens(doc_id)


def simulate(trace: Sequence[TraceRequest], policy_name: str, capacity_blocks: int | None) -> RunResult:
    """Serve the trace in arrival order (``batch``: planned order) through engine and mirror."""
    synthesise_documents(trace)
    result = RunResult(policy_name)
    server = Server(capacity_blocks, result)
    if policy_name in BATCH_POLICIES:
        start, cpu_start = time.perf_counter(), time.process_time()
        plan = plan_batch([r.docs for r in trace])
        result.index_s = time.perf_counter() - start
        result.index_cpu_s = time.process_time() - cpu_start
        order = plan.order if policy_name == "batch" else range(len(trace))
        for i in order:
            server.serve(trace[i], plan.contexts[i])
        return result
    if policy_name == "myopic-oracle":
        for request in trace:
            oracle = MyopicOracleOrder(server.engine.probe())
            server.serve(request, oracle.order(server.tree, request.docs).doc_ids)
        return result
    policy = get_policy(policy_name)
    for request in trace:
        question = server.question()
        start, cpu_start = time.perf_counter_ns(), time.thread_time_ns()
        docs = policy.order(server.tree, request.docs).doc_ids
        layout = server.layout(docs, question)
        result.overhead_cpu_us.append((time.thread_time_ns() - cpu_start) / 1e3)
        result.overhead_us.append((time.perf_counter_ns() - start) / 1e3)
        server.serve(request, docs, layout)
        # Dropped here, as a server drops a prompt when its request ends: rebinding the names in
        # the next timed call would charge it with freeing this prompt, and with the garbage
        # collections its objects, still alive beside the new prompt's, set off there.
        del docs, layout
    return result


def myopic_oracle_wins(trace: Sequence[TraceRequest], capacity_blocks: int | None) -> int:
    """Requests of an ``exact`` run for which some other order would have reused more, judged on
    the simulated engine itself. A run of its own: the exhaustive search would pollute the CPU
    caches between the requests whose ordering cost the timed run measures."""
    synthesise_documents(trace)
    server = Server(capacity_blocks, RunResult("exact"))
    policy = get_policy("exact")
    wins = 0
    for request in trace:
        best = MyopicOracleOrder(server.engine.probe()).order(server.tree, request.docs).cached
        layout = server.layout(policy.order(server.tree, request.docs).doc_ids, server.question())
        ends = [seg.end for seg in layout.segments if seg.kind == "document"]
        cached = server.serve(request, layout.document_ids(), layout)
        wins += (best.tokens, best.docs) > (cached, cached_docs(ends, cached))
    return wins


def simulate_replay(
    trace: Sequence[TraceRequest],
    capacity_blocks: int | None,
    admission: Admission,
    *,
    window: Window,
    rate_per_s: float | None = None,
    starvation_window_s: float = 10.0,
) -> RunResult:
    """Replay the trace through one prefill slot (see bench.ordering.replay): Poisson arrivals at
    ``rate_per_s`` if given, else the trace's own times, else at :data:`REPLAY_LOAD`."""
    synthesise_documents(trace)
    profile = PrefillProfile()
    if rate_per_s is None and any(r.arrival_s is None for r in trace):
        rate_per_s = saturating_rate([prompt_tokens(r.docs) for r in trace], profile, REPLAY_LOAD)
    result = RunResult(f"replay-{admission}")
    stats = replay(
        trace,
        arrival_times(trace, rate_per_s),
        Server(capacity_blocks, result),
        admission,
        window=window,
        starvation_window_s=starvation_window_s,
        profile=profile,
    )
    result.replay = stats.summary()
    return result


def lru_capacity(trace: Sequence[TraceRequest]) -> int:
    """10 % of the blocks the trace would store if nothing were ever reused."""
    blocks = sum(prompt_tokens(r.docs) // BLOCK_SIZE for r in trace)
    return max(1, round(LRU_FRACTION * blocks))


def capacity(trace: Sequence[TraceRequest], cache: Cache) -> int | None:
    return None if cache == "unlimited" else lru_capacity(trace)


def run_policy(
    trace: Sequence[TraceRequest],
    policy: str,
    cache: Cache,
    *,
    window: Window | None = None,
    rate_per_s: float | None = None,
) -> RunResult:
    """One run of a policy with the tree mirroring the given cache."""
    if policy in REPLAY_POLICIES:
        admission = REPLAY_POLICIES[policy]
        window = window or Window()
        return simulate_replay(trace, capacity(trace, cache), admission, window=window, rate_per_s=rate_per_s)
    return simulate(trace, policy, capacity(trace, cache))


def dedup_savings(trace: Sequence[TraceRequest]) -> float:
    """Share of document slots multi-turn de-duplication removes from conversations' later turns."""
    dedup = SessionDeduplicator()
    removed = sum(len(dedup.dedup(r.conv, r.docs).repeated) for r in trace if r.conv is not None)
    return removed / max(sum(len(r.docs) for r in trace), 1)


def batch_index_times(sizes: Sequence[int]) -> list[dict[str, Any]]:
    """Wall and CPU seconds to plan ``n`` requests: Zipf (one large component, the dense case)
    and topic-cluster traces."""
    times: list[dict[str, Any]] = []
    for n in sizes:
        for name, trace in (("zipf", zipf_trace(n, seed=n)), ("topics", topic_cluster_trace(n, seed=n))):
            contexts = [r.docs for r in trace]
            start, cpu_start = time.perf_counter(), time.process_time()
            plan_batch(contexts)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            times.append({"trace": name, "n": n, "seconds": wall, "cpu_seconds": cpu})
    return times


def full_benchmark(quick: bool) -> dict[str, Any]:
    n = 400 if quick else 2000
    traces = {
        # without its own arrival times, so that every trace is replayed at REPLAY_LOAD
        "topics": [replace(r, arrival_s=None) for r in topic_cluster_trace(n, seed=4)],
        "zipf": zipf_trace(n, seed=1),
        "bursty": bursty_trace(n, seed=2),
        "multiturn": multiturn_trace(n, seed=3),
    }
    results: dict[str, Any] = {}
    for name, trace in traces.items():
        rows: dict[str, Any] = {}
        for policy in BENCH_POLICIES:
            rows[policy] = {cache: run_policy(trace, policy, cache).summary() for cache in CACHES}
            if policy == "exact":
                for cache in CACHES:
                    wins = myopic_oracle_wins(trace, capacity(trace, cache))
                    rows[policy][cache]["requests_myopic_oracle_beat_exact"] = wins
            print(f"{name:10s} {policy:14s} {json.dumps(rows[policy])}", file=sys.stderr)
        results[name] = rows
    return {
        "machine": machine(),
        "block_size": BLOCK_SIZE,
        "requests_per_trace": n,
        "k": 10,
        "lru_fraction": LRU_FRACTION,
        "replay_load": REPLAY_LOAD,
        "traces": results,
        "multiturn_dedup_slot_savings": dedup_savings(traces["multiturn"]),
        "batch_index_time": batch_index_times([250, 500, 1000, 2000] + ([] if quick else [4000])),
    }


def emit_mode(args: argparse.Namespace) -> dict[str, Any]:
    trace = read_trace(args.trace)
    window = Window.parse(args.window)
    runs = {
        cache: run_policy(trace, args.policy, cache, window=window, rate_per_s=args.rate) for cache in CACHES
    }
    if args.emit is not None:
        atomic_write_text(args.emit, runs[args.emit_cache].emitted())
    return {
        "policy": args.policy,
        "requests": len(trace),
        "emitted_from": args.emit_cache,
        "independent": runs[args.emit_cache].summary()["independent"],
        "prefix_reuse": {cache: run.summary() for cache, run in runs.items()},
    }
