"""Does the KV mirror keep pace with a pool of GPU replicas? vLLM's own ``KVEventBatch``es at rising
rates into a subscriber and mirror running as in the service, while its event loop answers.

Rerun: ``.venv/bin/python -m bench.capacity.mirror_rate [--quick]`` (about 8 minutes: 60 s at each
rate; ``--quick``: 10 s at each of fewer rates, about 2 minutes, too short to check the 60 s
target). Writes bench/out/mirror_rate.json and .png; the last line printed is a JSON summary.
``run(quick)`` does the same for ``python -m bench.capacity`` (``measure(quick)`` inside a running
event loop).

- The publisher is a separate process running vLLM's own ``ZmqEventPublisher`` (made through its
  public ``KVEventsConfig``, as a vLLM server makes it: PUB with its ``hwm``, ROUTER replay socket
  keeping 10,000 batches), publishing ``KVEventBatch``es of vLLM's own event classes as an engine
  step would: each batch stores 16 blocks of 16 tokens continuing a 2,048-token prompt and, once
  the modelled cache of 26,000 blocks is full, removes 16 (whole prompts' blocks, tail first, the
  order vLLM frees them in): 32 block events a batch.
- The subscriber side is the service's: a :class:`KVMirror` over a :class:`KnowledgeTree`,
  subscribed with a replay from batch 0 (its receiving thread, the loop applying a bounded amount
  per turn), on an event loop that also runs the stand-in for answering: every 5 ms it wakes and
  does 1 ms of CPU work. Its wake-up delay is the loop's responsiveness (p50/p99), measured
  without events first (``rate 0``) and then at each rate.
- Each rate runs for its duration, then the mirror gets up to 30 s to apply what it received.
  Per rate: block events/s achieved (stored + removed block hashes), batches, lost batches (the
  mirror's counter: neither received nor replayed), whether every batch was applied and the
  mirror still exact, its lag (batches and seconds behind, sampled every 20 ms: p50/p99/max) and
  the CPU share of both processes.

``mirror_events_per_s_no_loss``: the highest block-event rate achieved with 0 lost batches, every
batch applied and the mirror exact; ``mirror_events_per_s_kept_pace``: the same with the lag's p99
under 1 s too (a mirror seconds behind predicts from an old cache, though it loses nothing). The
target, 50,000 block events/s for 60 s, is derived in
docs/capacity.md ("The mirror's event rate").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from matplotlib import pyplot as plt

from bench.common import print_summary, save_figure, write_report
from specrag.cache.tree import KnowledgeTree
from specrag.pipeline.engines.config import KVEventSource
from specrag.pipeline.kv_mirror.mirror import KVMirror

NAME = "mirror_rate"
RERUN = "bench.capacity.mirror_rate"
RATES = (12_500, 25_000, 50_000, 75_000, 100_000, 150_000)
QUICK_RATES = (12_500, 50_000, 100_000)
SECONDS, QUICK_SECONDS = 60.0, 10.0
BASELINE_SECONDS, QUICK_BASELINE_SECONDS = 10.0, 5.0
TARGET_EVENTS_PER_S = 50_000
BLOCK_SIZE = 16  # vLLM's default on GPUs
BLOCKS_PER_STEP = 16  # stored per batch (and as many removed once the cache is full)
PROMPT_BLOCKS = 128  # a 2,048-token prompt
CACHE_BLOCKS = 26_000  # an 8B model's KV in what an 80 GB H100 leaves it (docs/capacity.md)
TOPIC = "kv"
START_TIMEOUT_S = 180.0
DRAIN_S = 30.0
KEPT_PACE_LAG_S = 1.0
SAMPLE_EVERY_S = 0.02
ANSWER_EVERY_S, ANSWER_CPU_S = 0.005, 0.001


# ---------------------------------------------------------------------- the publisher's process


class EngineSteps:
    """The KV events of an engine prefilling distinct 2,048-token prompts into a full LRU cache."""

    def __init__(self) -> None:
        self._next_hash = 1
        self._parent: int | None = None
        self._in_prompt = 0
        self._prompt: list[int] = []
        self._evictable: deque[int] = deque()
        self._cached = 0

    def step(self) -> tuple[int, list[Any]]:
        """One step's block-event count and events (vLLM's own classes)."""
        from vllm.distributed import kv_events as vllm_events

        hashes = list(range(self._next_hash, self._next_hash + BLOCKS_PER_STEP))
        self._next_hash += BLOCKS_PER_STEP
        events: list[Any] = [
            vllm_events.BlockStored(
                block_hashes=list[int | bytes](hashes),
                parent_block_hash=self._parent,
                token_ids=[(h * 7 + i) % 32_000 for h in hashes for i in range(BLOCK_SIZE)],
                block_size=BLOCK_SIZE,
                lora_id=None,
                medium=vllm_events.MEDIUM_GPU,
                lora_name=None,
            )
        ]
        self._prompt.extend(hashes)
        self._cached += BLOCKS_PER_STEP
        self._in_prompt += BLOCKS_PER_STEP
        self._parent = hashes[-1]
        if self._in_prompt >= PROMPT_BLOCKS:  # the prompt is done: its blocks are freed tail first
            self._evictable.extend(reversed(self._prompt))
            self._prompt, self._parent, self._in_prompt = [], None, 0
        removed = 0
        if self._cached > CACHE_BLOCKS:
            count = min(BLOCKS_PER_STEP, len(self._evictable))
            evicted: list[int | bytes] = [self._evictable.popleft() for _ in range(count)]
            if evicted:
                events.append(vllm_events.BlockRemoved(block_hashes=evicted, medium=vllm_events.MEDIUM_GPU))
                self._cached -= len(evicted)
                removed = len(evicted)
        return BLOCKS_PER_STEP + removed, events


def publish_events(endpoint: str, replay_endpoint: str, commands: Connection) -> None:
    """The publisher process: vLLM's ZmqEventPublisher, publishing at the rates it is sent."""
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed import kv_events as vllm_events

    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=endpoint,
        replay_endpoint=replay_endpoint,
        topic=TOPIC,
    )
    publisher = vllm_events.EventPublisherFactory.create(config)
    steps = EngineSteps()
    commands.send("ready")
    try:
        while (order := commands.recv()) is not None:
            rate, seconds = order
            commands.send(_publish_at(publisher, steps, rate, seconds))
    finally:
        publisher.shutdown()


def _publish_at(publisher: Any, steps: EngineSteps, rate: float, seconds: float) -> dict[str, float]:
    from vllm.distributed import kv_events as vllm_events

    start = time.perf_counter()
    batches = block_events = 0
    while (elapsed := time.perf_counter() - start) < seconds:
        while block_events < rate * elapsed:
            count, events = steps.step()
            publisher.publish(vllm_events.KVEventBatch(ts=time.time(), events=events))
            batches += 1
            block_events += count
        time.sleep(0.001)
    return {"batches": batches, "block_events": block_events, "seconds": time.perf_counter() - start}


# ---------------------------------------------------------------------- the service's side


class Answering:
    """The loop's other work: wake every ``ANSWER_EVERY_S``, compute for ``ANSWER_CPU_S``; the
    wake-up delays (ms) say how responsive the loop stayed."""

    def __init__(self) -> None:
        self.delays_ms: list[float] = []

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(ANSWER_EVERY_S)
            self.delays_ms.append((loop.time() - asked - ANSWER_EVERY_S) * 1000)
            until = time.perf_counter() + ANSWER_CPU_S
            while time.perf_counter() < until:
                pass

    def take(self) -> list[float]:
        taken, self.delays_ms = self.delays_ms, []
        return taken


def _percentiles(values: list[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {f"{prefix}_p50": None, f"{prefix}_p99": None, f"{prefix}_max": None}
    array = np.asarray(values)
    return {
        f"{prefix}_p50": float(np.percentile(array, 50)),
        f"{prefix}_p99": float(np.percentile(array, 99)),
        f"{prefix}_max": float(array.max()),
    }


async def _sample_lag(mirror: KVMirror, batches: list[float], seconds: list[float]) -> None:
    while True:
        lag = mirror.lag()
        batches.append(lag.batches)
        seconds.append(lag.seconds)
        await asyncio.sleep(SAMPLE_EVERY_S)


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


class Bench:
    """The publisher process, the mirror and the loop's other work, for one run of rates."""

    def __init__(self, commands: Connection, mirror: KVMirror, publisher: psutil.Process) -> None:
        self._commands = commands
        self.mirror = mirror
        self._publisher = publisher
        self.answering = Answering()
        self.published = 0

    async def ask(self, rate: float, seconds: float) -> dict[str, float]:
        self._commands.send((rate, seconds))
        if not await asyncio.to_thread(self._commands.poll, seconds + START_TIMEOUT_S):
            raise TimeoutError(f"the publisher did not report within {seconds + START_TIMEOUT_S} s")
        report: dict[str, float] = self._commands.recv()
        return report

    async def baseline(self, seconds: float) -> dict[str, Any]:
        """The loop's responsiveness with no events at all."""
        self.answering.take()
        await asyncio.sleep(seconds)
        return {"rate_target": 0, **_percentiles(self.answering.take(), "loop_delay_ms")}

    async def rate(self, rate: float, seconds: float) -> dict[str, Any]:
        own = psutil.Process()
        before = self.mirror.faults()
        cpu_before = (_cpu_seconds(own), _cpu_seconds(self._publisher))
        lag_batches: list[float] = []
        lag_seconds: list[float] = []
        sampler = asyncio.create_task(_sample_lag(self.mirror, lag_batches, lag_seconds))
        self.answering.take()
        started = time.perf_counter()
        try:
            report = await self.ask(rate, seconds)
            delays = self.answering.take()
            wall = time.perf_counter() - started
            cpu = (_cpu_seconds(own) - cpu_before[0], _cpu_seconds(self._publisher) - cpu_before[1])
            self.published += int(report["batches"])
            drain_s = await self._drain()
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        after = self.mirror.faults()
        lost = after.lost_batches - before.lost_batches
        applied = after.applied_batches - before.applied_batches
        return {
            "rate_target": rate,
            "seconds": report["seconds"],
            "batches": int(report["batches"]),
            "block_events": int(report["block_events"]),
            "block_events_per_s": report["block_events"] / report["seconds"],
            "batches_per_s": report["batches"] / report["seconds"],
            "lost_batches": lost,
            "applied_batches": applied,
            "all_applied": after.applied_batches == self.published,
            "drain_s": drain_s,
            "exact_at_end": self.mirror.status.exact,
            "mirror_reason": self.mirror.status.reason,
            **_percentiles(lag_batches, "lag_batches"),
            **_percentiles(lag_seconds, "lag_seconds"),
            **_percentiles(delays, "loop_delay_ms"),
            "service_cpu_share": cpu[0] / wall,
            "publisher_cpu_share": cpu[1] / wall,
        }

    async def _drain(self) -> float | None:
        """Seconds until every batch published was applied (or lost), None if not within DRAIN_S."""
        started = time.perf_counter()
        while time.perf_counter() - started < DRAIN_S:
            faults = self.mirror.faults()
            if (
                faults.applied_batches + faults.lost_batches >= self.published
                and self.mirror.lag().batches == 0
            ):
                return time.perf_counter() - started
            await asyncio.sleep(0.05)
        return None


def passed(row: dict[str, Any]) -> bool:
    """0 lost, every batch applied, the mirror exact at the end."""
    return row["lost_batches"] == 0 and row["all_applied"] and row["exact_at_end"]


def kept_pace(row: dict[str, Any]) -> bool:
    """Passed, and never far behind: the lag's p99 under ``KEPT_PACE_LAG_S``."""
    return passed(row) and row["lag_seconds_p99"] is not None and row["lag_seconds_p99"] < KEPT_PACE_LAG_S


def summarize(rows: list[dict[str, Any]], *, quick: bool, seconds: float) -> dict[str, Any]:
    """The run's result from its rows (the first one the baseline without events)."""
    measured = rows[1:]
    best = max((row["block_events_per_s"] for row in measured if passed(row)), default=0.0)
    return {
        "quick": quick,
        "seconds_per_rate": seconds,
        "rates": rows,
        "mirror_events_per_s_no_loss": best,
        "mirror_events_per_s_kept_pace": max(
            (row["block_events_per_s"] for row in measured if kept_pace(row)), default=0.0
        ),
        "mirror_lost_batches": sum(row["lost_batches"] for row in measured),
        "target_events_per_s": TARGET_EVENTS_PER_S,
        "target_met": best >= TARGET_EVENTS_PER_S and not quick,
        "model": {
            "block_size": BLOCK_SIZE,
            "blocks_stored_per_batch": BLOCKS_PER_STEP,
            "prompt_blocks": PROMPT_BLOCKS,
            "cache_blocks": CACHE_BLOCKS,
            "answer_every_s": ANSWER_EVERY_S,
            "answer_cpu_s": ANSWER_CPU_S,
        },
    }


@contextlib.contextmanager
def publisher_process(directory: Path) -> Iterator[tuple[Connection, BaseProcess, KVEventSource]]:
    """The publisher's process on ``directory``'s IPC endpoints; told to stop at the end."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    source = KVEventSource(f"ipc://{directory}/events", f"ipc://{directory}/replay", TOPIC)
    assert source.replay_endpoint is not None
    process = context.Process(
        target=publish_events, args=(source.endpoint, source.replay_endpoint, theirs), name="kv-publisher"
    )
    process.start()
    try:
        yield ours, process, source
    finally:
        with contextlib.suppress(OSError, BrokenPipeError):
            ours.send(None)
        process.join(10)
        if process.is_alive():
            process.terminate()
            process.join(5)


async def _started(commands: Connection, process: BaseProcess) -> None:
    """Wait for the publisher's "ready" (it imports vLLM first), failing early if it died."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not await asyncio.to_thread(commands.poll, 1.0):
        if not process.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the publisher process did not start (exit code {process.exitcode})")
    if commands.recv() != "ready":
        raise RuntimeError("the publisher process said something other than ready")


async def measure(quick: bool) -> dict[str, Any]:
    """The run, inside a running event loop (see the module docstring)."""
    rates = QUICK_RATES if quick else RATES
    seconds = QUICK_SECONDS if quick else SECONDS
    with (
        tempfile.TemporaryDirectory(prefix="mirror-rate-") as directory,
        publisher_process(Path(directory)) as (commands, process, source),
    ):
        await _started(commands, process)
        assert process.pid is not None
        mirror = KVMirror(KnowledgeTree((), block_size=BLOCK_SIZE), source, name="bench")
        await mirror.start()
        bench = Bench(commands, mirror, psutil.Process(process.pid))
        answering = asyncio.create_task(bench.answering.run())
        try:
            rows = [await bench.baseline(QUICK_BASELINE_SECONDS if quick else BASELINE_SECONDS)]
            for rate in rates:
                rows.append(await bench.rate(rate, seconds))
                print(_line(rows[-1]), flush=True)
        finally:
            answering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await answering
            await mirror.stop()
    return {**summarize(rows, quick=quick, seconds=seconds), "load_average_1m": psutil.getloadavg()[0]}


def _line(row: dict[str, Any]) -> str:
    return (
        f"rate {row['rate_target']:>7}: {row['block_events_per_s']:>9.0f} block events/s, "
        f"lost {row['lost_batches']}, applied all {row['all_applied']}, exact {row['exact_at_end']}, "
        f"lag p99 {row['lag_batches_p99']:.0f} batches / {row['lag_seconds_p99']:.3f} s, "
        f"loop delay p99 {row['loop_delay_ms_p99']:.2f} ms"
    )


def draw(result: dict[str, Any], path: Path) -> None:
    rows = result["rates"][1:]
    figure, (lag_axis, loop_axis) = plt.subplots(1, 2, figsize=(11, 4))
    rates = [row["block_events_per_s"] / 1000 for row in rows]
    colours = ["tab:green" if passed(row) else "tab:red" for row in rows]
    lag_axis.scatter(rates, [(row["lag_seconds_p99"] or 0) * 1000 for row in rows], c=colours)
    lag_axis.set_xlabel("block events/s (thousands)")
    lag_axis.set_ylabel("mirror lag p99 (ms)")
    lag_axis.set_yscale("symlog", linthresh=1.0)
    lag_axis.set_title("green: 0 lost, all applied, exact")
    lag_axis.axvline(TARGET_EVENTS_PER_S / 1000, color="grey", linestyle="--")
    baseline = result["rates"][0]["loop_delay_ms_p99"]
    loop_axis.plot(rates, [row["loop_delay_ms_p99"] for row in rows], marker="o", label="with events")
    if baseline is not None:
        loop_axis.axhline(baseline, color="grey", linestyle="--", label="no events")
    loop_axis.set_xlabel("block events/s (thousands)")
    loop_axis.set_ylabel("loop wake-up delay p99 (ms)")
    loop_axis.legend()
    figure.suptitle(f"KV mirror keeping pace ({result['seconds_per_rate']:.0f} s a rate)")
    save_figure(figure, path)


def run(quick: bool) -> dict[str, Any]:
    """Measure, write bench/out/mirror_rate.json and .png, and return the result."""
    result = asyncio.run(measure(quick))
    write_report(NAME, result, lambda path: draw(result, path))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="10 s at 3 rates instead of 60 s at 6")
    result = run(parser.parse_args().quick)
    keys = (
        "mirror_events_per_s_no_loss",
        "mirror_events_per_s_kept_pace",
        "mirror_lost_batches",
        "target_met",
        "quick",
    )
    print_summary({key: result[key] for key in keys}, RERUN)


if __name__ == "__main__":
    main()
