"""Ordering benchmark: prefix reuse of every ordering policy on document-ID traces.

The engine is simulated at block granularity the way vLLM's APC works: a prompt's full blocks
are keyed by chained content, a request reuses its leading cached blocks, and the pool is
either unlimited or an LRU of 10 % of the blocks the trace would store without any reuse. The
simulated engine publishes BlockStored / BlockRemoved events and the knowledge tree follows
them, exactly as it follows vLLM's. Prompts are laid out as the service lays them out
(``specrag.pipeline.store.prompt``): 32-token KV blocks, the system prompt and every document padded to
a block multiple. Documents get deterministic synthetic tokens (24-199 before padding, as this
benchmark always used, so that overhead figures compare across versions; the default corpus'
passages are longer, ~240), generated already padded so that the simulated engine's
ground-truth probe, which concatenates documents, sees exactly what ``build_layout`` produces.

Every policy runs twice, its tree mirroring an unlimited cache and the bounded one. Reported per
trace, cache and policy: its own accounting (document slots and prompt tokens served from the
simulated cache), the *independent* score of the order it ran (``bench.ordering.score``: a slot
counts when its whole prefix was served before, unlimited and with an LRU of 10 % of the slots),
the per-request cost of ordering + prompt layout (µs, p50/p99) and, for ``exact``, how many
requests the myopic oracle (every order of the request, scored on the simulated engine itself)
beat it on for that request's own reuse. ``batch`` plans the whole trace offline; ``batch-arrival``
uses the plan's document orders but the arrival order of requests; ``window`` replays the trace at
its arrival times through one prefill slot (``bench.ordering.replay``), choosing request and
document order together over the waiting requests.

    python -m bench.ordering [--quick]                       # side-by-side, JSON + PNG in bench/out/
    python -m bench.ordering --trace IN.jsonl --policy exact --emit OUT.jsonl
    python -m bench.ordering --trace IN.jsonl --policy window --window 16 --emit OUT.jsonl
    python -m bench.ordering --trace IN.jsonl --policy window --window 500ms --rate 1.0
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from bench.common import machine, plot_path, print_summary, save_figure, write_json
from bench.ordering.oracle import MyopicOracleOrder
from bench.ordering.replay import Admission, Window, arrival_times, replay, saturating_rate
from bench.ordering.score import score
from bench.ordering.session_dedup import SessionDeduplicator
from bench.ordering.topic_traces import topic_cluster_trace
from bench.traces import TraceRequest, bursty_trace, multiturn_trace, read_trace, zipf_trace
from specrag.atomic import atomic_write_text
from specrag.cache import (
    POLICY_NAMES,
    BlockRemoved,
    BlockStored,
    DocId,
    KnowledgeTree,
    KVEvent,
    PrefillProfile,
    PrefixMatch,
    PromptLayout,
    build_layout,
    get_policy,
    plan_batch,
)
from specrag.cache.residency import ROOT_KEY, BlockPool, chain_block_keys
from specrag.errors import InvalidInputError

BLOCK_SIZE = 32  # the service's KV block (EngineConfig.block_size)
PAD_TOKEN = 0
SYSTEM_TOKENS = tuple(range(1, 65))
QUESTION_LEN = 16
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


@functools.cache
def doc_tokens(doc_id: DocId) -> tuple[int, ...]:
    """Deterministic synthetic tokens of a document (ids 1000+), padded to a block multiple."""
    seed = zlib.crc32(f"{type(doc_id).__name__}:{doc_id}".encode())
    rng = np.random.default_rng(seed)
    length = 24 + seed % 176
    tokens = tuple(int(t) for t in rng.integers(1000, 50_000, size=length))
    return tokens + (PAD_TOKEN,) * (-length % BLOCK_SIZE)


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


def _prompt_tokens(docs: Sequence[DocId]) -> int:
    return len(SYSTEM_TOKENS) + sum(len(doc_tokens(d)) for d in docs) + QUESTION_LEN


@dataclass
class RunResult:
    policy: str
    order: list[tuple[int | str, tuple[DocId, ...]]] = field(default_factory=list)
    slots: int = 0
    cached_slots: int = 0
    tokens: int = 0
    cached_tokens: int = 0
    overhead_us: list[float] = field(default_factory=list)  # wall clock: includes preemption
    overhead_cpu_us: list[float] = field(default_factory=list)  # this thread's CPU time only
    index_s: float | None = None
    index_cpu_s: float | None = None
    replay: dict[str, float] | None = None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "slot_reuse": self.cached_slots / max(self.slots, 1),
            "token_reuse": self.cached_tokens / max(self.tokens, 1),
            "independent": score([docs for _, docs in self.order]),
        }
        for name, values in (("overhead_us", self.overhead_us), ("overhead_cpu_us", self.overhead_cpu_us)):
            if values:
                out[f"{name}_p50"] = float(np.percentile(values, 50))
                out[f"{name}_p99"] = float(np.percentile(values, 99))
        if self.index_s is not None:
            out["index_s"] = self.index_s
            out["index_cpu_s"] = self.index_cpu_s
        if self.replay is not None:
            out["replay"] = self.replay
        return out

    def emitted(self) -> str:
        return "".join(json.dumps({"rid": rid, "docs": list(docs)}) + "\n" for rid, docs in self.order)


class Server:
    """The simulated engine, the knowledge tree mirroring it, and the run's accounting."""

    def __init__(self, capacity_blocks: int | None, result: RunResult) -> None:
        self.engine = SimulatedAPC(capacity_blocks)
        self.tree = KnowledgeTree(SYSTEM_TOKENS, block_size=BLOCK_SIZE, max_nodes=500_000)
        self.result = result

    def prompt_tokens(self, request: TraceRequest) -> int:
        return _prompt_tokens(request.docs)

    def question(self) -> tuple[int, ...]:
        """The next request's question tokens: every prompt gets its own."""
        start = 900_000 + len(self.result.order) * QUESTION_LEN
        return tuple(range(start, start + QUESTION_LEN))

    def layout(self, docs: Sequence[DocId], question: Sequence[int]) -> PromptLayout:
        """The prompt as the service lays it out (``specrag.pipeline.store.prompt.PromptBuilder``)."""
        return build_layout(
            SYSTEM_TOKENS,
            [(d, doc_tokens(d)) for d in docs],
            question,
            block_size=BLOCK_SIZE,
            pad_token_id=PAD_TOKEN,
        )

    def serve(self, request: TraceRequest, docs: Sequence[DocId], layout: PromptLayout | None = None) -> int:
        """Run one prompt through the engine, update the mirror; return its cached tokens."""
        layout = layout or self.layout(docs, self.question())
        cached_blocks, events = self.engine.serve(layout.token_ids)
        cached = cached_blocks * BLOCK_SIZE
        ends = [s.end for s in layout.segments if s.kind == "document"]
        self.tree.record_served(layout, cached)
        self.tree.apply_events(events)
        result = self.result
        result.order.append((request.rid, tuple(docs)))
        result.slots += len(docs)
        result.cached_slots += _cached_docs(ends, cached)
        result.tokens += len(layout.token_ids)
        result.cached_tokens += cached
        return cached


def _synthesise_documents(trace: Sequence[TraceRequest]) -> None:
    """Make every document's tokens before anything is timed."""
    for request in trace:
        for doc_id in request.docs:
            doc_tokens(doc_id)


def simulate(trace: Sequence[TraceRequest], policy_name: str, capacity_blocks: int | None) -> RunResult:
    """Serve the trace in arrival order (``batch``: planned order) through engine and mirror."""
    _synthesise_documents(trace)
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
    _synthesise_documents(trace)
    server = Server(capacity_blocks, RunResult("exact"))
    policy = get_policy("exact")
    wins = 0
    for request in trace:
        best = MyopicOracleOrder(server.engine.probe()).order(server.tree, request.docs).cached
        layout = server.layout(policy.order(server.tree, request.docs).doc_ids, server.question())
        ends = [seg.end for seg in layout.segments if seg.kind == "document"]
        cached = server.serve(request, layout.document_ids(), layout)
        wins += (best.tokens, best.docs) > (cached, _cached_docs(ends, cached))
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
    _synthesise_documents(trace)
    profile = PrefillProfile()
    if rate_per_s is None and any(r.arrival_s is None for r in trace):
        rate_per_s = saturating_rate([_prompt_tokens(r.docs) for r in trace], profile, REPLAY_LOAD)
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
    blocks = sum(_prompt_tokens(r.docs) // BLOCK_SIZE for r in trace)
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


def plot(report: dict[str, Any]) -> Path:
    import matplotlib.pyplot as plt

    traces = list(report["traces"])
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    width = 0.8 / len(BENCH_POLICIES)
    for ax, scored in zip(axes[:2], ("unlimited", "lru"), strict=True):
        for j, policy in enumerate(BENCH_POLICIES):
            values = [report["traces"][t][policy]["lru10"]["independent"][scored] for t in traces]
            ax.bar(np.arange(len(traces)) + j * width, values, width, label=policy)
        ax.set_xticks(np.arange(len(traces)) + 0.4 - width / 2, traces)
        ax.set_ylabel("document slots whose prefix was served before")
        cache = "unlimited cache" if scored == "unlimited" else "LRU of 10 % of slots"
        ax.set_title(f"independent score, {cache}")
    axes[0].legend(fontsize=8, ncol=2)
    for name in ("zipf", "topics"):
        sizes = [s for s in report["batch_index_time"] if s["trace"] == name]
        axes[2].plot([s["n"] for s in sizes], [s["cpu_seconds"] for s in sizes], marker="o", label=name)
    axes[2].legend()
    axes[2].set_xlabel("requests (k = 10)")
    axes[2].set_ylabel("CPU seconds")
    axes[2].set_title("batch index (cluster + order + schedule)")
    path = save_figure(fig, plot_path("ordering"), dpi=110)
    return path


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ordering", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, help="JSONL doc-ID trace; without it, run the full benchmark")
    parser.add_argument("--policy", help=f"with --trace: one of {', '.join(BENCH_POLICIES)}")
    parser.add_argument("--emit", type=Path, help="with --trace: write the requests in execution order here")
    parser.add_argument(
        "--emit-cache",
        choices=CACHES,
        default="lru10",
        help="which run to emit: the tree mirroring the bounded cache (default) or an unlimited one",
    )
    parser.add_argument("--window", default="16", help="window policy: waiting requests (16) or time (250ms)")
    parser.add_argument("--rate", type=float, help="window policy: Poisson arrivals a second")
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
            summary = emit_mode(args)
    except (InvalidInputError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
