"""Ordering benchmark: prefix reuse of every ordering policy on document-ID traces.

The engine is simulated at block granularity the way vLLM's APC works: a prompt's full blocks
are keyed by chained content, a request reuses its leading cached blocks, and the pool is
either unlimited or an LRU of 10 % of the blocks the trace would store without any reuse. The
simulated engine publishes BlockStored / BlockRemoved events and the knowledge tree follows
them, exactly as it follows vLLM's. Documents get deterministic synthetic tokens (24-199 per
document, block size 16), so token reuse counts partial documents and straddling blocks.

Reported per trace, cache and policy: reuse over document slots and over prompt tokens, the
per-request cost of ordering + prompt build (µs, p50/p99), for ``exact`` how many requests the
oracle (every order, scored on the simulated engine itself) beat it on, and for ``batch`` the
time to index the whole trace; plus batch index time against n. ``batch-arrival`` uses the batch
plan's document orders but the arrival order of requests.

    python -m bench.ordering [--quick]                       # side-by-side, JSON + PNG in bench/out/
    python -m bench.ordering --trace IN.jsonl --policy exact --emit OUT.jsonl
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import machine, plot_path, write_json
from bench.traces import TraceRequest, bursty_trace, multiturn_trace, read_trace, zipf_trace
from specrag.atomic import atomic_write_text
from specrag.cache import (
    POLICY_NAMES,
    BlockRemoved,
    BlockStored,
    DocId,
    KnowledgeTree,
    KVEvent,
    PrefixMatch,
    SessionDeduplicator,
    build_layout,
    get_policy,
    plan_batch,
)
from specrag.cache.ordering import OracleOrder
from specrag.cache.residency import ROOT_KEY, BlockPool, chain_block_keys
from specrag.errors import InvalidInputError

BLOCK_SIZE = 16
SYSTEM_TOKENS = tuple(range(1, 65))
QUESTION_LEN = 16
LRU_FRACTION = 0.10
# ``batch`` runs the trace in its planned order; ``batch-arrival`` keeps the arrival order and
# takes only the batch plan's document orders, so it compares context ordering with the online
# policies on equal terms (an online server cannot reorder requests that have not arrived).
BATCH_POLICIES = ("batch", "batch-arrival")
BENCH_POLICIES = (*POLICY_NAMES, *BATCH_POLICIES)


@functools.cache
def doc_tokens(doc_id: DocId) -> tuple[int, ...]:
    """Deterministic synthetic tokens of a document (ids 1000+, so never the system prompt's)."""
    seed = zlib.crc32(f"{type(doc_id).__name__}:{doc_id}".encode())
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(1000, 50_000, size=24 + seed % 176))


class SimulatedAPC:
    """vLLM's prefix cache (the shared :class:`BlockPool` model), publishing vLLM-like events.

    Each prompt runs start to finish before the next (:meth:`BlockPool.serve`): reuse depends on
    the block pool's contents and eviction order, not on timing, so no engine steps are simulated.
    """

    def __init__(self, capacity_blocks: int | None) -> None:
        self._lru = BlockPool(capacity_blocks)

    def serve(self, token_ids: Sequence[int]) -> tuple[int, list[KVEvent]]:
        """Run one prompt: return its cached blocks and the events its blocks caused."""
        keys = chain_block_keys(token_ids, BLOCK_SIZE)
        served = self._lru.serve(keys)
        new = set(served.stored)
        events: list[KVEvent] = []
        run: list[int] = []
        for i, key in enumerate([*keys, None]):  # one BlockStored per run of consecutive new blocks
            if key in new:
                run.append(i)
                continue
            if run:
                parent = _engine_hash(keys[run[0] - 1]) if run[0] else None
                tokens = tuple(token_ids[run[0] * BLOCK_SIZE : (run[-1] + 1) * BLOCK_SIZE])
                events.append(
                    BlockStored(tuple(_engine_hash(keys[j]) for j in run), parent, tokens, BLOCK_SIZE)
                )
                run = []
        if served.evicted:
            events.append(BlockRemoved(tuple(_engine_hash(k) for k in served.evicted)))
        return served.cached_blocks, events

    def probe(self) -> Callable[[Sequence[DocId]], PrefixMatch]:
        """Ground-truth reuse of a document order, memoised per prefix (for the oracle)."""
        system_keys = chain_block_keys(SYSTEM_TOKENS, BLOCK_SIZE)
        root = _ProbeState(
            blocks=len(system_keys),
            leading=self._lru.leading_cached(system_keys),
            last_key=system_keys[-1] if system_keys else ROOT_KEY,
            pending=SYSTEM_TOKENS[len(system_keys) * BLOCK_SIZE :],
            ends=(),
        )
        memo: dict[tuple[DocId, ...], _ProbeState] = {(): root}

        def state(prefix: tuple[DocId, ...]) -> _ProbeState:
            if prefix not in memo:
                parent = state(prefix[:-1])
                document = doc_tokens(prefix[-1])
                start = parent.ends[-1] if parent.ends else len(SYSTEM_TOKENS)
                tokens = parent.pending + document
                keys = chain_block_keys(tokens, BLOCK_SIZE, parent.last_key)
                leading = parent.leading
                if leading == parent.blocks:
                    leading += self._lru.leading_cached(keys)
                memo[prefix] = _ProbeState(
                    blocks=parent.blocks + len(keys),
                    leading=leading,
                    last_key=keys[-1] if keys else parent.last_key,
                    pending=tokens[len(keys) * BLOCK_SIZE :],
                    ends=(*parent.ends, start + len(document)),
                )
            return memo[prefix]

        def probe(prefix: Sequence[DocId]) -> PrefixMatch:
            s = state(tuple(prefix))
            tokens = s.leading * BLOCK_SIZE
            return PrefixMatch(_cached_docs(s.ends, tokens), tokens, s.leading == s.blocks)

        return probe


@dataclass(frozen=True, slots=True)
class _ProbeState:
    blocks: int  # full blocks up to the end of the prefix's documents
    leading: int  # of those, how many are cached from the first
    last_key: int
    pending: tuple[int, ...]  # tokens after the last full block
    ends: tuple[int, ...]  # end offset of each document


def _engine_hash(key: int) -> int:
    """The engine's own hash differs from our content key; the tree must translate."""
    return hash(("engine", key))


def _cached_docs(segment_ends: Sequence[int], cached_tokens: int) -> int:
    """Leading documents lying entirely inside the reused blocks."""
    return bisect.bisect_right(segment_ends, cached_tokens)


def _prompt_blocks(request: TraceRequest) -> int:
    length = len(SYSTEM_TOKENS) + sum(len(doc_tokens(d)) for d in request.docs) + QUESTION_LEN
    return length // BLOCK_SIZE


@dataclass
class RunResult:
    policy: str
    order: list[tuple[int | str, tuple[DocId, ...]]] = field(default_factory=list)
    slots: int = 0
    cached_slots: int = 0
    tokens: int = 0
    cached_tokens: int = 0
    overhead_us: list[float] = field(default_factory=list)
    oracle_better: int = 0
    index_s: float | None = None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "slot_reuse": self.cached_slots / max(self.slots, 1),
            "token_reuse": self.cached_tokens / max(self.tokens, 1),
        }
        if self.overhead_us:
            out["overhead_us_p50"] = float(np.percentile(self.overhead_us, 50))
            out["overhead_us_p99"] = float(np.percentile(self.overhead_us, 99))
        if self.policy == "exact":
            out["requests_oracle_beat_exact"] = self.oracle_better
        if self.index_s is not None:
            out["index_s"] = self.index_s
        return out


def simulate(trace: Sequence[TraceRequest], policy_name: str, capacity_blocks: int | None) -> RunResult:
    """Serve the trace in the policy's order through the simulated engine and the mirror."""
    engine = SimulatedAPC(capacity_blocks)
    tree = KnowledgeTree(SYSTEM_TOKENS, block_size=BLOCK_SIZE, max_nodes=500_000)
    result = RunResult(policy_name)
    for request in trace:  # synthesise every document's tokens before anything is timed
        for doc_id in request.docs:
            doc_tokens(doc_id)
    schedule: list[tuple[TraceRequest, tuple[DocId, ...] | None]] = [(r, None) for r in trace]
    if policy_name in BATCH_POLICIES:
        start = time.perf_counter()
        plan = plan_batch([r.docs for r in trace])
        result.index_s = time.perf_counter() - start
        order = plan.order if policy_name == "batch" else range(len(trace))
        schedule = [(trace[i], plan.contexts[i]) for i in order]
    policy = None if policy_name in (*BATCH_POLICIES, "oracle") else get_policy(policy_name)
    for index, (request, planned) in enumerate(schedule):
        question = tuple(range(900_000 + index * QUESTION_LEN, 900_000 + (index + 1) * QUESTION_LEN))
        start = time.perf_counter()
        if planned is not None:
            docs = planned
        elif policy is not None:
            docs = policy.order(tree, request.docs).doc_ids
        else:
            docs = OracleOrder(engine.probe()).order(tree, request.docs).doc_ids
        layout = build_layout(SYSTEM_TOKENS, [(d, doc_tokens(d)) for d in docs], question)
        if policy is not None:
            result.overhead_us.append((time.perf_counter() - start) * 1e6)
        if policy_name == "exact":
            best = OracleOrder(engine.probe()).order(tree, request.docs).cached
        cached_blocks, events = engine.serve(layout.token_ids)
        ends = [s.end for s in layout.segments if s.kind == "document"]
        cached_docs = _cached_docs(ends, cached_blocks * BLOCK_SIZE)
        if policy_name == "exact" and (best.tokens, best.docs) > (cached_blocks * BLOCK_SIZE, cached_docs):
            result.oracle_better += 1
        tree.record_served(layout, cached_blocks * BLOCK_SIZE)
        tree.apply_events(events)
        result.order.append((request.rid, docs))
        result.slots += len(docs)
        result.cached_slots += cached_docs
        result.tokens += len(layout.token_ids)
        result.cached_tokens += cached_blocks * BLOCK_SIZE
    return result


def lru_capacity(trace: Sequence[TraceRequest]) -> int:
    """10 % of the blocks the trace would store if nothing were ever reused."""
    return max(1, round(LRU_FRACTION * sum(_prompt_blocks(r) for r in trace)))


def run_trace(trace: Sequence[TraceRequest], policy: str) -> tuple[RunResult, RunResult]:
    return simulate(trace, policy, None), simulate(trace, policy, lru_capacity(trace))


def dedup_savings(trace: Sequence[TraceRequest]) -> float:
    """Share of document slots multi-turn de-duplication removes from conversations' later turns."""
    dedup = SessionDeduplicator()
    removed = sum(len(dedup.dedup(r.conv, r.docs).repeated) for r in trace if r.conv is not None)
    return removed / max(sum(len(r.docs) for r in trace), 1)


def batch_index_times(sizes: Sequence[int]) -> list[dict[str, float]]:
    times = []
    for n in sizes:
        contexts = [r.docs for r in zipf_trace(n, seed=n)]
        start = time.perf_counter()
        plan_batch(contexts)
        times.append({"n": n, "seconds": time.perf_counter() - start})
    return times


def full_benchmark(quick: bool) -> dict[str, Any]:
    n = 400 if quick else 2000
    traces = {
        "zipf": zipf_trace(n, seed=1),
        "bursty": bursty_trace(n, seed=2),
        "multiturn": multiturn_trace(n, seed=3),
    }
    results: dict[str, Any] = {}
    for name, trace in traces.items():
        rows: dict[str, Any] = {}
        for policy in BENCH_POLICIES:
            unlimited, lru = run_trace(trace, policy)
            rows[policy] = {"unlimited": unlimited.summary(), "lru10": lru.summary()}
            print(f"{name:10s} {policy:10s} {json.dumps(rows[policy])}", file=sys.stderr)
        results[name] = rows
    return {
        "machine": machine(),
        "block_size": BLOCK_SIZE,
        "requests_per_trace": n,
        "k": 10,
        "traces": results,
        "multiturn_dedup_slot_savings": dedup_savings(traces["multiturn"]),
        "batch_index_time": batch_index_times([250, 500, 1000, 2000] + ([] if quick else [4000])),
    }


def plot(report: dict[str, Any]) -> Path:
    import matplotlib.pyplot as plt

    traces = list(report["traces"])
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    width = 0.8 / len(BENCH_POLICIES)
    for ax, cache in zip(axes[:2], ("unlimited", "lru10"), strict=True):
        for j, policy in enumerate(BENCH_POLICIES):
            values = [report["traces"][t][policy][cache]["token_reuse"] for t in traces]
            ax.bar(np.arange(len(traces)) + j * width, values, width, label=policy)
        ax.set_xticks(np.arange(len(traces)) + 0.4 - width / 2, traces)
        ax.set_ylabel("prompt tokens reused")
        ax.set_title(
            f"prefix reuse, {'unlimited cache' if cache == 'unlimited' else 'LRU of 10 % of blocks'}"
        )
    axes[0].legend(fontsize=8, ncol=2)
    sizes = report["batch_index_time"]
    axes[2].plot([s["n"] for s in sizes], [s["seconds"] for s in sizes], marker="o")
    axes[2].set_xlabel("requests (k = 10)")
    axes[2].set_ylabel("seconds")
    axes[2].set_title("batch index (cluster + order + schedule)")
    fig.tight_layout()
    path = plot_path("ordering")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def emit_mode(trace_path: Path, policy: str, emit: Path | None) -> dict[str, Any]:
    trace = read_trace(trace_path)
    unlimited, lru = run_trace(trace, policy)
    if emit is not None:
        lines = [json.dumps({"rid": rid, "docs": list(docs)}) + "\n" for rid, docs in unlimited.order]
        atomic_write_text(emit, "".join(lines))
    return {
        "policy": policy,
        "requests": len(trace),
        "prefix_reuse": {"unlimited": unlimited.summary(), "lru10": lru.summary()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ordering", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, help="JSONL doc-ID trace; without it, run the full benchmark")
    parser.add_argument("--policy", help=f"with --trace: one of {', '.join(BENCH_POLICIES)}")
    parser.add_argument("--emit", type=Path, help="with --trace: write the requests in execution order here")
    parser.add_argument("--quick", action="store_true", help="smaller traces (finishes in about two minutes)")
    args = parser.parse_args(argv)
    try:
        if args.trace is None:
            if args.policy or args.emit:
                raise InvalidInputError("--policy and --emit need --trace")
            start = time.perf_counter()
            report = full_benchmark(args.quick)
            report["wall_s"] = time.perf_counter() - start
            json_path = write_json("ordering", report)
            summary = {"json": str(json_path), "png": str(plot(report)), "wall_s": report["wall_s"]}
        else:
            if args.policy not in BENCH_POLICIES:
                raise InvalidInputError(f"unknown policy {args.policy!r}; known: {', '.join(BENCH_POLICIES)}")
            summary = emit_mode(args.trace, args.policy, args.emit)
    except (InvalidInputError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
