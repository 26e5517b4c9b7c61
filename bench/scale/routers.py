"""Scale-out: routing policies compared on the same traces, simulated and real replicas, and a kill.

``python -m bench.scale [--quick]`` replays :mod:`bench.traces`' ``bursty`` and ``multiturn``
traces (Poisson arrivals) through each router of :mod:`specrag.controller.placement`:

- **simulated**: 8 simulated replicas (vLLM's prefix-cache semantics and the measured prefill
  profile), each with a KV cache smaller than the working set, so where a prompt goes decides what
  it reuses. The simulation runs in virtual time (:mod:`specrag.sim.virtual_time`): TTFTs
  are simulated milliseconds, and neither the machine's load nor the router's own CPU time enters
  them or the queues the routers read; that CPU time is measured (in real time) and reported
  beside them as ``router_cpu_ms``.
- **real**: 2 in-process vLLM replicas of the default model, each pinned to its own core, each
  with its own KV events feeding its own tree; prompts of real passages.
- **reuse bound** (:func:`reuse_bound`): per simulated trace, what no router reuses more than
  with specrag's ordering (one replica of unbounded cache and compute), with every earlier prompt
  finished (``sequential``) or with only the blocks computed before each arrival (``in_time``).
- **kill**: the real pair under the ``specrag`` router; one replica's engine core is killed
  mid-run, while an answer streams from it. ``failed`` counts queries that got no whole answer;
  ``retried`` those that were waiting for their first token there (resubmitted elsewhere),
  ``migrated`` those that were streaming (continued elsewhere from the prompt plus the tokens
  already sent); ``max_gap_s`` is the longest time from the kill to the next token of any of them.

A query is one engine request placed by the router (documents ordered per replica where the
router does that), retried on another replica when it fails before its first token and migrated
there when it fails after it; a later
turn of a conversation continues the previous prompt and answer and adds only new documents.
The last line printed is the JSON summary; the whole result goes to ``bench/out/scale.json`` and
the plot to ``bench/out/scale.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import math
import os
import random
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.common import (
    engine_cores,
    machine,
    plot_path,
    print_summary,
    save_figure,
    stop_cleanly_on_sigterm,
    write_json,
)
from bench.e2e.workload import arrivals
from bench.traces import TraceRequest, bursty_trace, multiturn_trace
from specrag.cache.events import BlockStored
from specrag.cache.layout import DocId, PromptLayout, build_layout
from specrag.cache.ordering import get_policy
from specrag.cache.pgdsf import PrefillProfile
from specrag.cache.residency import chain_block_keys
from specrag.cache.tree import KnowledgeTree
from specrag.controller.config import DEFAULT_INTER_TOKEN_TIMEOUT_S
from specrag.controller.flight import Flight, RetriedFlight
from specrag.controller.gate import PrefillGate
from specrag.controller.placement import ROUTERS, Placed, Placement, health_checks
from specrag.controller.replicas import Replica
from specrag.errors import EngineError
from specrag.pipeline.engines.protocol import Sampling, now
from specrag.sim import virtual_time
from specrag.sim.replicas import simulated_replica

if TYPE_CHECKING:  # annotations only: the real pair imports the service side when it runs
    from specrag.pipeline.store.prompt import PromptBuilder
    from specrag.service.run.assets import Assets

POLICY = get_policy("exact")
BLOCK = 32
SIM_REPLICAS = 8
SIM_SYSTEM = tuple(range(3, 3 + 160))  # a 160-token system prompt (5 blocks)
SIM_DOC_TOKENS = (180, 300)  # passage lengths, as the default corpus' (~240 tokens)
SIM_CAPACITY_BLOCKS = 1536  # ~49k tokens per replica: ~18 prompts, less than a trace's working set
SIM_MAX_MODEL_LEN = 32768  # long conversations: every turn carries the whole history
REAL_CORES = ("0", "1")


@dataclass
class Sample:
    """One query's outcome."""

    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int
    replica: str
    retried_from: str | None = None
    first_token_at: float | None = None
    error: str | None = None
    route_cpu_s: float = 0.0
    migrated_from: str | None = None  # the replica that failed after the first token
    resumed_at: float | None = None  # the first token after the migration


@dataclass
class Replay:
    """What a replay needs besides the trace: the prompt pieces and the engines' clock."""

    system: Sequence[int]
    document: Callable[[DocId], Sequence[int]]
    question: Callable[[int], Sequence[int]]
    sampling: Sampling
    first_token_timeout_s: float = 120.0
    inter_token_timeout_s: float = DEFAULT_INTER_TOKEN_TIMEOUT_S
    samples: list[Sample] = field(default_factory=list)


# ------------------------------------------------------------------------------------- one query


async def run_query(
    placement: Placement,
    placed: Placed,
    replay: Replay,
    gate: PrefillGate,
    on_prefilled: Callable[[Flight], None] | None = None,
) -> tuple[Sample, tuple[int, ...]]:
    """Run one placed prompt to its end (the sample and the answer's tokens); a failure before the
    first token is retried on another replica, one after it migrates the answer there, as the
    controller does (:class:`RetriedFlight`)."""
    arrival = now()
    retried_from: list[str] = []
    migrated_from: list[str] = []

    def launch(placed: Placed, sent: tuple[int, ...] = ()) -> Flight:
        slot = gate.try_speculate()
        assert slot is not None  # the gate is unbounded: the engines queue by themselves
        flight = Flight(placed, replay.sampling, slot, speculative=False, sent=sent)
        if on_prefilled is not None and not sent:  # a prompt its tree records (as run.py does)
            placed.replica.tree.record_pending(placed.layout)
            flight.on_prefilled = on_prefilled
        return flight

    async def resubmit(placed: Placed, failed: Flight, error: EngineError, sent: tuple[int, ...]) -> Flight:
        (migrated_from if sent else retried_from).append(failed.replica.name)
        await failed.abort()
        return launch(placed, sent)

    query = RetriedFlight(
        launch(placed),
        placement,
        replay.first_token_timeout_s,
        resubmit,
        inter_token_timeout_s=replay.inter_token_timeout_s,
    )
    answer: list[int] = []
    answered_by: Flight | None = None  # the request that gave the first token
    try:
        async for output in query.outputs():
            answered_by = answered_by or query.flight
            answer.extend(output.token_ids)
    finally:
        await query.flight.abort()
    flight = answered_by or query.flight
    first = flight.first_token_at
    ttft = None if first is None else first - arrival
    sample = Sample(
        ttft,
        len(flight.layout.token_ids),
        flight.cached_tokens or 0,
        flight.replica.name,
        retried_from[0] if retried_from else None,
        first,
        migrated_from=migrated_from[0] if migrated_from else None,
        resumed_at=query.flight.first_token_at if migrated_from else None,
    )
    return sample, tuple(answer)


def served(flight: Flight) -> None:
    """At its first token, the replica's tree counts the prompt as served, as run.py does (its
    document path was recorded as pending at submission, so that prompts placed before this first
    token see its blocks as their KV events arrive, and can follow its order).

    Only for a prompt that starts with the system prompt and documents: a later turn of a
    conversation starts with its history, whose documents sit at other positions (run.py keeps
    a session's prompts out of the tree too), and recording it would give the documents after
    the history spans that no first turn can reuse.
    """
    flight.replica.tree.record_served(flight.layout, flight.cached_tokens)


async def replay_trace(
    placement: Placement, trace: Sequence[TraceRequest], times: Sequence[float], replay: Replay
) -> list[Sample]:
    """Every request at its arrival time; a conversation's turns one after the other."""
    gate = PrefillGate(1 << 30, 0.0)
    histories: dict[str, tuple[int, ...]] = {}
    seen: dict[str, set[DocId]] = {}
    locks: dict[str, asyncio.Lock] = {}

    def build(doc_ids: Sequence[DocId], question: Sequence[int], prefix: Sequence[int]) -> PromptLayout:
        documents = [(d, replay.document(d)) for d in doc_ids]
        return build_layout(prefix, documents, question, block_size=BLOCK, pad_token_id=0)

    async def one(request: TraceRequest, number: int) -> Sample:
        question = replay.question(number)
        conv = request.conv
        async with locks.setdefault(conv or f"#{number}", asyncio.Lock()):
            history = histories.get(conv) if conv is not None else None
            routing = time.perf_counter()  # real time even in a simulation: what routing costs
            if history is None:
                placed = placement.place_documents(
                    POLICY, request.docs, lambda docs: build(docs, question, replay.system)
                )
            else:
                fresh = [d for d in request.docs if d not in seen[conv]]  # type: ignore[index]
                placed = placement.place_prompt(build(fresh, question, history))
            routing = time.perf_counter() - routing
            try:
                sample, answer = await run_query(
                    placement, placed, replay, gate, served if history is None else None
                )
                sample.route_cpu_s = routing
            except EngineError as error:  # counted as failed, not retried further
                return Sample(None, len(placed.layout.token_ids), 0, placed.replica.name, error=str(error))
            if conv is not None:
                histories[conv] = (*placed.layout.token_ids, *answer)
                seen.setdefault(conv, set()).update(request.docs)
            return sample

    started = now()
    tasks = []
    for number, (request, at) in enumerate(zip(trace, times, strict=True)):
        delay = started + at - now()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request, number)))
    return list(await asyncio.gather(*tasks))


def summary(samples: Sequence[Sample], with_p99: bool = True) -> dict[str, float]:
    ttfts = np.array([s.ttft_s for s in samples if s.ttft_s is not None]) * 1000
    prompt = sum(s.prompt_tokens for s in samples)
    result = {
        "cached_token_share": round(sum(s.cached_tokens for s in samples) / prompt, 4) if prompt else 0.0,
        "ttft_mean_ms": round(float(ttfts.mean()), 1) if len(ttfts) else float("nan"),
    }
    if with_p99:
        result["ttft_p99_ms"] = round(float(np.percentile(ttfts, 99)), 1) if len(ttfts) else float("nan")
    return result


def merge(parts: Sequence[Sequence[Sample]], with_p99: bool = True) -> dict[str, float]:
    return summary([s for part in parts for s in part], with_p99)


# ------------------------------------------------------------------------------------- bounds


def reuse_bound(
    trace: Sequence[TraceRequest], replay: Replay, times: Sequence[float] | None = None
) -> tuple[int, int]:
    """Cached and prompt tokens of the best reuse of this trace with specrag's ordering.

    One replica with an unbounded cache and unbounded compute, its system prompt cached from the
    start; every first turn ordered by :data:`POLICY` against every earlier one (the best prefix
    the tree holds, then the travelled path); a later turn reuses its whole history (the previous
    prompt and a ``max_tokens`` answer). With ``times`` a prompt reuses only blocks computed before
    it arrived, each earlier prefill running alone at full speed from its arrival (an engine fixes
    a request's hit when it schedules it, so only waiting could do better); without, every earlier
    prompt is complete when the next arrives (each waited for the one before). The prompts have
    the replay's lengths, so the share is over the same tokens as the routers'. Not a theorem
    over all orders: the ordering is :data:`POLICY`'s, given everything that came before.
    """
    tree = KnowledgeTree(replay.system, block_size=BLOCK)
    profile = PrefillProfile()
    computed: list[tuple[float, int, BlockStored]] = []  # (when, sequence, the block's event)
    histories: dict[str, int] = {}
    seen: dict[str, set[DocId]] = {}
    cached_total = prompt_total = 0

    def compute(token_ids: Sequence[int], cached: int, at: float) -> None:
        keys = chain_block_keys(token_ids, BLOCK)
        for index in range(cached // BLOCK, len(keys)):
            end = (index + 1) * BLOCK
            parent = keys[index - 1] if index else None
            event = BlockStored((keys[index],), parent, tuple(token_ids[end - BLOCK : end]), BLOCK)
            heapq.heappush(computed, (at + profile.cost(cached, end - cached), len(computed), event))

    compute(replay.system, 0, -math.inf)
    for number, request in enumerate(trace):
        arrival = math.inf if times is None else times[number]
        while computed and computed[0][0] <= arrival:
            tree.apply_events([heapq.heappop(computed)[2]])
        question, conv = replay.question(number), request.conv
        if conv is None or conv not in histories:
            ordered = POLICY.order(tree, request.docs).doc_ids
            documents = [(d, replay.document(d)) for d in ordered]
            layout = build_layout(replay.system, documents, question, block_size=BLOCK, pad_token_id=0)
            cached = tree.cached_tokens(layout.token_ids)
            tree.record_served(layout, cached)
            compute(layout.token_ids, cached, arrival if times is not None else -math.inf)
        else:
            history = histories[conv]
            fresh = [(d, replay.document(d)) for d in request.docs if d not in seen[conv]]
            layout = build_layout((0,) * history, fresh, question, block_size=BLOCK, pad_token_id=0)
            cached = min(history, len(layout.token_ids) - 1) // BLOCK * BLOCK
        if conv is not None:
            histories[conv] = len(layout.token_ids) + replay.sampling.max_tokens
            seen.setdefault(conv, set()).update(request.docs)
        cached_total += cached
        prompt_total += len(layout.token_ids)
    return cached_total, prompt_total


def reuse_bounds(n: int, rate: float, seed: int) -> dict[str, dict[str, float]]:
    """:func:`reuse_bound`'s share on each simulated trace and on both, sequential and in time."""
    replay, times = simulated_replay(), simulated_times(n, rate, seed)
    result = {}
    for variant, at in (("sequential", None), ("in_time", times)):
        counts = {name: reuse_bound(trace, replay, at) for name, trace in traces(n, seed).items()}
        counts["both"] = (sum(c for c, _ in counts.values()), sum(p for _, p in counts.values()))
        result[variant] = {name: round(cached / prompt, 4) for name, (cached, prompt) in counts.items()}
    return result


# ------------------------------------------------------------------------------------- simulated


def synthetic_document(doc_id: DocId) -> tuple[int, ...]:
    """A passage's tokens: a fixed function of its id (so every replica sees the same blocks)."""
    rng = random.Random(f"doc-{doc_id}")
    return tuple(rng.randrange(3, 1000) for _ in range(rng.randint(*SIM_DOC_TOKENS)))


def synthetic_question(number: int) -> tuple[int, ...]:
    rng = random.Random(f"question-{number}")
    return tuple(rng.randrange(3, 1000) for _ in range(16))


def traces(n: int, seed: int) -> dict[str, list[TraceRequest]]:
    return {
        "bursty": bursty_trace(n, topics=100, docs_per_topic=20, seed=seed),
        "multiturn": multiturn_trace(n, corpus=2000, active=16, seed=seed),
    }


def simulated_replay() -> Replay:
    return Replay(SIM_SYSTEM, synthetic_document, synthetic_question, Sampling(max_tokens=8))


def simulated_times(n: int, rate: float, seed: int) -> list[float]:
    """The traces' Poisson arrival times (seconds from the start)."""
    return [float(at) for at in arrivals(n, rate, 1.0, np.random.default_rng(seed))]


async def simulated(n: int, rate: float, seed: int) -> dict[str, dict[str, Any]]:
    """Every router on every trace, each run on fresh replicas (empty caches); run it in virtual time."""
    results: dict[str, dict[str, Any]] = {}
    times = simulated_times(n, rate, seed)
    for name, trace in traces(n, seed).items():
        for router in ROUTERS:
            replicas = [
                simulated_replica(
                    f"r{i}",
                    SIM_SYSTEM,
                    block_size=BLOCK,
                    capacity_blocks=SIM_CAPACITY_BLOCKS,
                    max_model_len=SIM_MAX_MODEL_LEN,
                )
                for i in range(SIM_REPLICAS)
            ]
            samples = await replay_trace(Placement(replicas, router=router), trace, times, simulated_replay())
            for replica in replicas:
                await replica.engine.close()
            results.setdefault(router, {})[name] = samples
            print(f"simulated {name:9s} {router:22s} {summary(samples)}", flush=True)
    return results


# ------------------------------------------------------------------------------------- real


@contextlib.asynccontextmanager
async def real_replicas(
    data_dir: Path | None, eager: bool
) -> AsyncIterator[tuple[list[Replica], Any, list[int]]]:
    """Two vLLM replicas of the default model, one per core, each mirrored by its own tree.

    Yields the replicas, the assets, and each replica's engine-core process id (for the kill).
    """
    from specrag.paths import DataLayout, resolve_data_dir
    from specrag.pipeline.engines.config import EngineConfig
    from specrag.pipeline.engines.vllm_engine import VllmEngine
    from specrag.pipeline.kv_mirror.mirror import KVMirror
    from specrag.pipeline.models.random_model import RANDOM_MODEL_NAME
    from specrag.service.run.assembly import prompt_builder
    from specrag.service.run.assets import ensure_assets

    layout = DataLayout(resolve_data_dir(data_dir))
    assets = ensure_assets(layout, RANDOM_MODEL_NAME)
    replicas: list[Replica] = []
    mirrors: list[KVMirror] = []
    cores: list[int] = []
    try:
        for number, core in enumerate(REAL_CORES):
            run_dir = layout.root / "run" / f"scale-{number}"
            run_dir.mkdir(parents=True, exist_ok=True)
            config = EngineConfig(
                model=str(assets.model_dir), enforce_eager=eager, omp_threads_bind=core
            ).with_kv_events(run_dir, topic=f"kv-{number}")
            known = {process.pid for process in engine_cores()}
            engine = await VllmEngine.start(config)
            cores += [p.pid for p in engine_cores() if p.pid not in known and p.pid is not None][:1]
            replica = Replica.for_engine(
                f"r{number}", engine, prompt_builder(assets, engine).system_layout_tokens()
            )
            tree = replica.tree
            replicas.append(replica)
            source = config.kv_event_source()
            assert source is not None  # the replica's config publishes its events
            mirror = KVMirror(tree, source)
            await mirror.start()
            mirrors.append(mirror)
        yield replicas, assets, cores
    finally:
        for mirror in mirrors:
            await mirror.stop()
        for replica in replicas:
            await replica.engine.close()


async def reset(replicas: Sequence[Replica]) -> None:
    for replica in replicas:
        if replica.available:
            await replica.engine.reset_prefix_cache()
            replica.tree.engine_cache_cleared()
            replica.speed = 1.0


def real_replay(builder: PromptBuilder, assets: Assets, seed: int) -> Replay:
    """The real pair's prompt pieces: the corpus' passages in a seeded order as the trace's documents."""
    rows = np.random.default_rng(seed).permutation(len(assets.passages))
    return Replay(
        builder.system_layout_tokens(),  # padded with the tokenizer's pad token, as the trees hold it
        lambda doc: assets.store.tokens(int(rows[int(doc) % len(rows)])),
        lambda number: builder.question_tokens(f"question {number}: what does this passage explain?"),
        Sampling(max_tokens=4),
    )


async def real(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every router on the real pair, then the kill (under ``specrag``)."""
    async with real_replicas(args.data_dir, args.eager) as (replicas, assets, cores):
        from specrag.service.run.assembly import prompt_builder

        replay = real_replay(prompt_builder(assets, replicas[0].engine), assets, args.seed)
        n = args.real_queries
        trace = bursty_trace(n, k=4, topics=10, docs_per_topic=8, burst=6, seed=args.seed)
        times = arrivals(n, args.real_rate, 1.0, np.random.default_rng(args.seed)).tolist()
        results: dict[str, Any] = {}
        for router in ROUTERS:
            await reset(replicas)
            samples = await replay_trace(Placement(replicas, router=router), trace, times, replay)
            results[router] = summary(samples, with_p99=False)
            print(f"real {router:22s} {results[router]}", flush=True)
        await reset(replicas)
        kill = await kill_run(replicas, cores, trace, times, replay, args.kill_after_s)
        print(f"kill {kill}", flush=True)
        return results, kill


KILL_WAIT_S = 30.0  # how long the kill waits for a query to be waiting somewhere


async def kill_run(
    replicas: list[Replica],
    cores: list[int],
    trace: Sequence[TraceRequest],
    times: Sequence[float],
    replay: Replay,
    kill_after_s: float,
) -> dict[str, Any]:
    """Replay under ``specrag``; ``kill_after_s`` in, kill the engine core of a replica at the first
    moment one has an answer streaming (the one with the most, then with the most queries waiting
    for their first token), so the kill tests the migration of a streaming answer and the retry of
    waiting queries rather than hitting an idle replica; if none streams within
    :data:`KILL_WAIT_S`, the replica with the most queries waiting."""
    placement = Placement(replicas)
    killed: dict[str, Any] = {}

    async def killer() -> None:
        await asyncio.sleep(kill_after_s)
        if len(cores) < len(replicas):
            raise RuntimeError("the engine-core processes of the replicas were not identified")

        def load(i: int) -> tuple[int, int]:
            return replicas[i].engine.load().decoding, replicas[i].pending

        for _ in range(round(KILL_WAIT_S / 0.01)):  # bounded: a replay with nothing streaming still ends
            if any(load(i)[0] for i in range(len(replicas))):
                break
            await asyncio.sleep(0.01)
        victim = max(range(len(replicas)), key=load)
        killed["replica"] = replicas[victim].name
        killed["streaming"], killed["waiting"] = load(victim)
        os.kill(cores[victim], signal.SIGKILL)
        killed["at"] = time.perf_counter()

    async with health_checks(placement):
        kill_task = asyncio.create_task(killer())
        try:
            samples = await replay_trace(placement, trace, times, replay)
        finally:
            await kill_task
    failed = sum(1 for s in samples if s.first_token_at is None or s.error is not None)
    victim, at = killed.get("replica"), killed.get("at")
    retried = [s.first_token_at for s in samples if s.retried_from == victim]
    migrated = [s.resumed_at for s in samples if s.migrated_from == victim]
    gaps = [token_at - at for token_at in (*retried, *migrated) if token_at is not None and at is not None]
    return {
        "killed": victim,
        "waiting_at_kill": killed.get("waiting"),
        "streaming_at_kill": killed.get("streaming"),
        "queries": len(trace),
        "failed": failed,
        "errors": [s.error for s in samples if s.error is not None],
        "retried": len(retried),
        "migrated": len(migrated),
        "max_gap_s": round(max(gaps), 3) if gaps else 0.0,
    }


# ------------------------------------------------------------------------------------- report


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    simulated_result = result["simulated"]
    x = np.arange(len(ROUTERS))
    axes[0].bar(x, [simulated_result[r]["cached_token_share"] for r in ROUTERS], color="tab:blue")
    axes[0].set_ylabel("cached prompt-token share")
    axes[1].bar(x, [simulated_result[r]["ttft_mean_ms"] for r in ROUTERS], color="tab:orange", label="mean")
    axes[1].scatter(x, [simulated_result[r]["ttft_p99_ms"] for r in ROUTERS], color="black", label="p99")
    axes[1].set_ylabel("TTFT (simulated ms)")
    axes[1].legend()
    for axis in axes:
        axis.set_xticks(x, ROUTERS, rotation=20)
    figure.suptitle(f"{SIM_REPLICAS} simulated replicas, bursty + multi-turn traces")
    save_figure(figure, path)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer queries (CI-sized)")
    parser.add_argument("--queries", type=int, default=None, help="simulated queries per trace")
    parser.add_argument("--rate", type=float, default=5.0, help="simulated arrivals per simulated second")
    parser.add_argument("--real-queries", type=int, default=None, help="queries per router on the real pair")
    parser.add_argument("--real-rate", type=float, default=1.0, help="arrivals per second on the real pair")
    parser.add_argument("--kill-after-s", type=float, default=5.0, help="when the kill comes")
    parser.add_argument("--no-real", action="store_true", help="skip the real replicas and the kill")
    parser.add_argument("--no-simulated", action="store_true", help="skip the simulated replicas")
    parser.add_argument("--eager", action="store_true", help="no graph compilation in the engines")
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.queries is None:
        args.queries = 300 if args.quick else 1000
    if args.real_queries is None:
        args.real_queries = 24 if args.quick else 60
    if args.queries < 1 or args.real_queries < 1 or args.rate <= 0:
        parser.error("queries and rates must be positive")
    return args


def router_cpu(samples: Sequence[Sample]) -> dict[str, float]:
    """What placing a query cost the router, in real milliseconds (mean and p99)."""
    spent = np.array([s.route_cpu_s for s in samples]) * 1000
    return {"mean": round(float(spent.mean()), 3), "p99": round(float(np.percentile(spent, 99)), 3)}


def simulated_results(args: argparse.Namespace) -> dict[str, Any]:
    """The simulation's part of the result, run in virtual time."""
    by_router = virtual_time.run(simulated(args.queries, args.rate, args.seed))
    bounds = reuse_bounds(args.queries, args.rate, args.seed)
    for variant, shares in bounds.items():
        print(f"reuse bound, {variant}: {shares}", flush=True)
    return {
        "reuse_bound": bounds,
        "simulated": {router: merge(list(runs.values())) for router, runs in by_router.items()},
        "simulated_by_trace": {
            router: {trace: summary(samples) for trace, samples in runs.items()}
            for router, runs in by_router.items()
        },
        "router_cpu_ms": {
            router: router_cpu([s for part in runs.values() for s in part])
            for router, runs in by_router.items()
        },
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    stop_cleanly_on_sigterm()
    started = time.perf_counter()
    result = {} if args.no_simulated else simulated_results(args)
    if not args.no_real:
        result["real"], result["kill"] = asyncio.run(real(args))
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    result["settings"] = {key: str(value) for key, value in vars(args).items()}
    result["machine"] = machine()
    write_json("scale", result)
    if "simulated" in result:
        plot(result, plot_path("scale"))
    last = ("simulated", "reuse_bound", "real", "kill")
    print_summary({key: result[key] for key in last if key in result})


if __name__ == "__main__":
    main()
