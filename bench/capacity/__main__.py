"""Capacity at GPU pace: how many answers a second specrag serves when the engine is not the slow part.

Rerun: ``.venv/bin/python -m bench.capacity --quick`` (docs/capacity.md gives its time, the
figures and the machine). For 1 and 4 replicas of the GPU-pace stand-in
(:mod:`specrag.sim.gpu_server`, an 8B model on one H100 by its time model), two front ends in turn,
each in its own process with CPU meters (:mod:`bench.capacity.serving`): specrag's service (HTTP,
the default corpus and embedder, staged search, speculation policy, ordering, KV mirrors), then the
thin baseline (:mod:`bench.capacity.thin`). Each gets open-loop Poisson arrivals at rising rates
(:mod:`bench.capacity.load`) until it no longer keeps up. Per rate: answers/s served, the added
time to first token (the client's TTFT less the stand-in's own modelled TTFT for the request the
answer came from), CPU ms per answer by component, the mirrors' state and the KV events a
second. The capacity is the served rate at the highest offered rate whose added TTFT p99 is
within 10 ms with nothing failed. The front end runs on ``--service-cpus``, the load generator
and the stand-ins on ``--client-cpus``, so that their work does not count as the front end's.
Output: bench/out/capacity.json, capacity.png and, last, the JSON summary.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.capacity import mirror_rate
from bench.capacity.embedding import EmbeddingServer, running_embedding_server
from bench.capacity.flags import parse_args
from bench.capacity.load import offer
from bench.capacity.replicas import StandIn, running_stand_ins, stop_process
from bench.capacity.report import (
    ADDED_TTFT_BOUND_MS,
    ELSEWHERE,
    draw,
    profile_per_answer,
    rate_point,
    summary,
)
from bench.common import OUT_DIR, plot_path, print_summary, run_measurement, write_json
from bench.e2e.workload import generate
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.service.run.assets import ensure_assets
from specrag.service.run.pools import free_port_pair

FRONTS = ("specrag", "thin")
FRONT_START_TIMEOUT_S = 600.0
WARM_UP_ANSWERS = 8
# A rate is the last one offered when the front served under this share of it, or its added TTFT
# p99 passed this many times the bound: higher rates would only queue.
KEEPS_UP_SHARE = 0.8
GIVES_UP_FACTOR = 20.0


def cores(spec: str | None) -> set[int] | None:
    return None if spec is None else {int(core) for core in spec.split(",")}


@contextlib.contextmanager
def front_process(
    front: str, stand_ins: Sequence[StandIn], args: Any, data_dir: Path, embedding: EmbeddingServer | None
) -> Iterator[tuple[str, str]]:
    """The front end's process (its URL and control URL) while the block runs, its questions
    embedded by ``embedding`` (None: in process); its log in bench/out."""
    port, control = free_port_pair(), free_port_pair()
    command = [sys.executable, "-m", "bench.capacity.serving", "--front", front, "--port", str(port)]
    command += ["--embedding-url", embedding.url] if embedding else []
    command += ["--control-port", str(control), "--data-dir", str(data_dir), "--k", str(args.k)]
    command += ["--model", args.model] + (["--cpus", args.service_cpus] if args.service_cpus else [])
    for stand_in in stand_ins:
        command += ["--engine-url", stand_in.url]
        if front == "specrag":
            command += ["--engine-kv-events", stand_in.kv_events]
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    log = (OUT_DIR / f"{args.name}-{front}{ELSEWHERE if embedding else ''}.log").open("w")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert process.stdout is not None
        readable, _, _ = select.select([process.stdout], [], [], FRONT_START_TIMEOUT_S)
        if not readable or process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {front} front did not start: see {log.name}")
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{control}"
    finally:
        stop_process(process, timeout_s=30)
        log.close()


async def state(session: aiohttp.ClientSession, control: str) -> dict[str, Any]:
    async with session.get(f"{control}/bench/state") as response:
        response.raise_for_status()
        result: dict[str, Any] = await response.json()
        return result


async def sweep(
    front: str,
    url: str,
    control: str,
    stand_ins: Sequence[StandIn],
    questions: Sequence[str],
    args: Any,
    profiles: dict[str, Any],
) -> list[dict[str, Any]]:
    """Every rate in turn, until the front no longer keeps up; with ``--profile`` the front's
    sampled profile of the whole sweep goes in ``profiles[front]``."""
    points: list[dict[str, Any]] = []
    url = f"{url}/v1/rag"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await offer(
            url, questions[-WARM_UP_ANSWERS:], 4.0, 2.0, k=args.k, max_tokens=args.max_tokens, seed=99
        )
        for stand_in in stand_ins:
            await stand_in.records(session)  # the warm-up's, forgotten
        if args.profile:
            await _profiler(session, control, "start")
        for number, rate in enumerate(args.rates):
            before = await state(session, control)
            events_before = [await s.published_events(session) for s in stand_ins]
            answers = await offer(
                url, questions, rate, args.seconds, k=args.k, max_tokens=args.max_tokens, seed=number
            )
            after = await state(session, control)
            events = sum([await s.published_events(session) for s in stand_ins]) - sum(events_before)
            records: dict[str, Any] = {}
            for stand_in in stand_ins:
                records.update(await stand_in.records(session))
            point = rate_point(
                rate, args.seconds, answers, records, before["cpu"], after["cpu"], after["mirrors"], events
            )
            points.append(point)
            print(
                f"{front} × {len(stand_ins)}: offered {rate:g}/s served {point['answers_per_s']:.1f}/s, "
                f"added TTFT p50/p99 {point['added_ttft_ms']['p50']}/{point['added_ttft_ms']['p99']} ms, "
                f"failed {point['failed']}, CPU {point['cpu_ms_per_answer']['total']} ms/answer",
                flush=True,
            )
            p99 = point["added_ttft_ms"]["p99"]
            if (
                point["answers_per_s"] < KEEPS_UP_SHARE * rate
                or p99 is None
                or p99 > GIVES_UP_FACTOR * ADDED_TTFT_BOUND_MS
            ):
                break
        if args.profile:
            figures = await _profiler(session, control, "stop")
            profiles[front] = profile_per_answer(figures, sum(point["answered"] for point in points))
    return points


async def _profiler(session: aiohttp.ClientSession, control: str, action: str) -> dict[str, Any]:
    """Start or stop the front's sampling profiler (:mod:`bench.capacity.serving`); its figures."""
    async with session.post(f"{control}/bench/profile/{action}") as response:
        response.raise_for_status()
        figures: dict[str, Any] = await response.json()
        return figures


async def measure(
    args: Any, data_dir: Path, questions: Sequence[str], profiles: dict[str, Any]
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int]]:
    """Each front in front of each replica count, its questions embedded in process; then, in
    front of the most replicas, embedded by the embedding stand-in (unless told not to). Also the
    stand-in's counts, to show it computed no question while measured; with ``--profile`` each
    run's profile in ``profiles``, by run."""
    runs: dict[str, list[dict[str, Any]]] = {}
    embedding_stats: dict[str, int] = {}
    for count in args.replicas:
        with running_stand_ins(count, cores(args.client_cpus)) as stand_ins:
            for front in FRONTS:
                await _reset(stand_ins)
                with front_process(front, stand_ins, args, data_dir, None) as (url, control):
                    label = f"{front}-{count}"
                    runs[label] = await sweep(label, url, control, stand_ins, questions, args, profiles)
            if count != max(args.replicas) or args.no_embedding_elsewhere:
                continue
            measured = 0  # texts the stand-in computed during the sweeps (not the fronts' starts)
            with running_embedding_server(questions, cores(args.client_cpus)) as embedding:
                for front in FRONTS:
                    await _reset(stand_ins)
                    with front_process(front, stand_ins, args, data_dir, embedding) as (url, control):
                        label = f"{front}-{count}{ELSEWHERE}"
                        before = await embedding.stats()
                        runs[label] = await sweep(label, url, control, stand_ins, questions, args, profiles)
                        after = await embedding.stats()
                        measured += after["computed_while_serving"] - before["computed_while_serving"]
                embedding_stats = after | {"computed_while_measured": measured}
    return runs, embedding_stats


async def _reset(stand_ins: Sequence[StandIn]) -> None:
    """Every front starts from empty prefix caches."""
    async with aiohttp.ClientSession() as session:
        for stand_in in stand_ins:
            if not await stand_in.reset_prefix_cache(session):
                raise RuntimeError(f"{stand_in.url} refused to reset its prefix cache")


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """The whole benchmark; returns the summary it also writes (bench/out/NAME.json)."""
    args = parse_args(argv)
    # Before any pinning: the mirror's own benchmark measures one process following the events.
    mirror = {} if args.no_mirror_rate else mirror_rate.run(args.quick)
    client_cores = cores(args.client_cpus)
    if client_cores:
        os.sched_setaffinity(0, client_cores)
    data_dir = resolve_data_dir(args.data_dir)
    assets = ensure_assets(DataLayout(data_dir), args.model)  # built once, here, before any front
    if isinstance(assets.corpus, LiveCorpus):
        assets.corpus.store.stop_writing()  # each front process writes the corpus' log in its turn
    trace = generate(assets.passages, "zipf", 2000, 1.0, seed=0)
    questions = [query.query for query in trace]
    profiles: dict[str, Any] = {}
    runs, embedding_stats = run_measurement(measure(args, data_dir, questions, profiles))
    headline = summary(runs, max(args.replicas)) | {
        key: mirror[key] for key in ("mirror_events_per_s_no_loss", "mirror_events_per_s_kept_pace") if mirror
    }
    if embedding_stats:
        headline["embedding_stand_in"] = embedding_stats
    settings = {key: value for key, value in vars(args).items() if key != "quick"} | {"quick": args.quick}
    write_json(
        args.name,
        {
            **headline,
            "settings": settings,
            "runs": runs,
            "added_ttft_bound_ms": ADDED_TTFT_BOUND_MS,
            **({"profiles": profiles} if profiles else {}),
        },
    )
    draw(runs, plot_path(args.name))
    return headline


def main() -> None:
    headline = run()
    print_summary(headline, "bench.capacity --quick")


if __name__ == "__main__":
    main()
