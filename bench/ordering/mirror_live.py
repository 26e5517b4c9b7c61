"""The KV mirror against a live ``specrag serve``: is every answer's predicted cached prefix what
the engine delivered, is the mirror exact at the end, and again soon after its engine restarts?

Rerun: ``.venv/bin/python -m bench.ordering.mirror_live`` (both phases on the embedded default
model, about ten minutes on two cores; ``--phase answers`` or ``--phase restart`` for one).
Writes bench/out/mirror_live.json and .png; the last line printed is a JSON summary.

- ``answers``: ``specrag serve --kv-cache-tokens 16384`` (a prefix cache small enough to evict);
  three groups of four identical questions sent at once (the engine computes the same blocks
  in parallel: duplicate copies), then 80 distinct questions, then eight of the earlier ones
  again. Per answer, the timeline's ``predicted_cached_tokens`` (the tree's prediction when the
  prompt was placed) against ``cached_prompt_tokens`` (what vLLM reported); at the end
  ``specrag_kv_mirror_exact``.
- ``restart``: ``specrag engine`` with KV events and ``specrag serve --engine-url`` on it, under a
  steady stream of questions; the engine is killed (SIGKILL) and started again on the same
  ports. Measured: from the new engine's ``/health`` 200 to ``specrag_kv_mirror_exact`` 1, and
  ``specrag_kv_mirror_sequence_resets_total`` before and after.

Both phases start the engine with ``--eager`` (no graph compilation: a shorter start, the same
cache behaviour).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from matplotlib import pyplot as plt
from prometheus_client.parser import text_string_to_metric_families

from bench.common import machine, print_summary, run_measurement, write_report
from bench.quality.questions import build_questions
from specrag.paths import DataLayout, resolve_data_dir
from specrag.retrieval.corpus import load_passages
from specrag.service.run.pools import free_port_pair

CACHE_TOKENS = 16384
START_TIMEOUT_S = 900.0
RERUN = "bench.ordering.mirror_live"


def _specrag(*args: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "specrag", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(process: subprocess.Popen[bytes], sig: int = signal.SIGINT) -> None:
    if process.poll() is None:
        os.killpg(process.pid, sig)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


async def _until_healthy(http: aiohttp.ClientSession, url: str, process: subprocess.Popen[bytes]) -> float:
    """Seconds until ``url``'s /health answers 200 (the process must stay alive meanwhile)."""
    began = time.perf_counter()
    while time.perf_counter() - began < START_TIMEOUT_S:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode} before it was ready")
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as response:
                if response.status == 200:
                    return time.perf_counter() - began
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} was not ready within {START_TIMEOUT_S:.0f} s")


async def _metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in (name, name + "_total")
    )


async def _ask(http: aiohttp.ClientSession, url: str, question: str, k: int) -> dict[str, Any]:
    body = {"query": question, "k": k, "mode": "ordering", "max_tokens": 4}
    async with http.post(url + "/v1/rag", json=body) as response:
        payload = await response.json()
        if response.status != 200:
            raise RuntimeError(f"{question!r}: {response.status} {payload}")
    timeline = payload["specrag"]
    return {
        "question": question,
        "predicted": timeline["predicted_cached_tokens"],
        "delivered": timeline["cached_prompt_tokens"],
        "prompt_tokens": timeline["prompt_tokens"],
    }


@contextlib.asynccontextmanager
async def _serving(args: Sequence[str], log: Path) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    port = free_port_pair()
    url = f"http://127.0.0.1:{port}"
    serve = _specrag("serve", "--port", str(port), *args, log=log)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            await _until_healthy(http, url, serve)
            yield http, url
    finally:
        _stop(serve)


async def answers_phase(questions: list[str], k: int, out: Path) -> dict[str, Any]:
    groups, distinct = questions[:3], questions[3:83]
    again = random.Random(1).sample(groups + distinct[:20], 8)
    async with _serving(["--eager", "--kv-cache-tokens", str(CACHE_TOKENS)], out / "answers-serve.log") as (
        http,
        url,
    ):
        rows: list[dict[str, Any]] = []
        for question in groups:  # four at once: the engine computes the same blocks in parallel
            rows += await asyncio.gather(*(_ask(http, url, question, k) for _ in range(4)))
        for question in distinct + again:
            rows.append(await _ask(http, url, question, k))
        await asyncio.sleep(1.0)  # the last answers' events
        exact = await _metric(http, url, "specrag_kv_mirror_exact")
        duplicates = await _metric(http, url, "specrag_kv_mirror_duplicate_copies")
    equal = sum(row["predicted"] == row["delivered"] for row in rows)
    return {
        "answers": len(rows),
        "predicted_equals_delivered": equal,
        "share_equal": equal / len(rows),
        "mirror_exact_at_end": exact,
        "duplicate_copies": duplicates,
        "cached_tokens": sum(row["delivered"] for row in rows),
        "prompt_tokens": sum(row["prompt_tokens"] for row in rows),
        "rows": rows,
    }


async def restart_phase(questions: list[str], k: int, out: Path) -> dict[str, Any]:
    engine_port, kv_port = free_port_pair(), free_port_pair()
    engine_url = f"http://127.0.0.1:{engine_port}"
    engine_args = ("engine", "--eager", "--port", str(engine_port), "--kv-events-port", str(kv_port))
    engine = _specrag(*engine_args, log=out / "restart-engine.log")
    serve_args = ["--engine-url", engine_url, "--engine-kv-events", f"tcp://127.0.0.1:{kv_port}"]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as engine_http:
            await _until_healthy(engine_http, engine_url, engine)
            async with _serving(serve_args, out / "restart-serve.log") as (http, url):
                for question in questions[:8]:
                    await _ask(http, url, question, k)
                resets_before = await _metric(http, url, "specrag_kv_mirror_sequence_resets")
                statuses: list[tuple[float, int]] = []

                async def load() -> None:  # a steady stream of questions through the restart
                    for question in itertools.cycle(questions[8:]):
                        body = {"query": question, "k": k, "mode": "ordering", "max_tokens": 4}
                        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                            async with http.post(url + "/v1/rag", json=body) as response:
                                await response.read()
                                statuses.append((time.perf_counter(), response.status))
                        await asyncio.sleep(0.2)

                loader = asyncio.create_task(load())
                await asyncio.sleep(3.0)
                _stop(engine, signal.SIGKILL)
                engine = _specrag(*engine_args, log=out / "restart-engine.log")
                engine_start_s = await _until_healthy(engine_http, engine_url, engine)
                back = time.perf_counter()
                # Exact again: the service saw the new engine (a reset counted) and its mirror is exact.
                exact_after_s = None
                while time.perf_counter() - back < 120:
                    resets = await _metric(http, url, "specrag_kv_mirror_sequence_resets")
                    if resets > resets_before and await _metric(http, url, "specrag_kv_mirror_exact") == 1:
                        exact_after_s = time.perf_counter() - back
                        break
                    await asyncio.sleep(0.1)
                resets_after = await _metric(http, url, "specrag_kv_mirror_sequence_resets")
                await asyncio.sleep(5.0)  # answers after the return
                loader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loader
    finally:
        _stop(engine)
    return {
        "engine_restart_s": engine_start_s,
        "exact_after_engine_health_s": exact_after_s,
        "sequence_resets_before": resets_before,
        "sequence_resets_after": resets_after,
        "statuses": dict(Counter(str(status) for _, status in statuses)),
        "answered_after_return": sum(status == 200 for at, status in statuses if at > back),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    figure, axis = plt.subplots(figsize=(6, 4))
    rows = result.get("answers", {}).get("rows", [])
    if rows:
        axis.scatter([row["delivered"] for row in rows], [row["predicted"] for row in rows], s=12)
        top = max(max(row["delivered"], row["predicted"]) for row in rows) or 1
        axis.plot([0, top], [0, top], color="grey", linewidth=0.8)
    axis.set_xlabel("cached prompt tokens the engine delivered")
    axis.set_ylabel("cached prompt tokens the mirror predicted")
    axis.set_title("KV mirror against a live specrag serve")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("answers", "restart", "both"), default="both")
    parser.add_argument("-k", type=int, default=3, help="passages per question (default %(default)s)")
    parser.add_argument("--data-dir", default=None, help="the data directory serve uses (default ./data)")
    args = parser.parse_args()
    if args.data_dir is not None:
        os.environ["SPECRAG_DATA_DIR"] = args.data_dir
    corpus = DataLayout(resolve_data_dir(args.data_dir)).corpus_file
    if not corpus.exists():  # a fresh machine: make the default model, corpus and index first
        subprocess.run([sys.executable, "-m", "specrag", "prepare"], check=True)
    passages = load_passages(corpus)
    questions = [q.question for q in build_questions(passages, 120, seed=7)]
    if len(questions) < 100:
        raise SystemExit(f"the corpus gives {len(questions)} questions; 100 are needed")
    out = Path("bench/out")
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"machine": machine(), "k": args.k, "cache_tokens": CACHE_TOKENS}
    if args.phase in ("answers", "both"):
        result["answers"] = run_measurement(answers_phase(questions, args.k, out))
    if args.phase in ("restart", "both"):
        result["restart"] = run_measurement(restart_phase(questions, args.k, out))
    write_report("mirror_live", result, lambda path: plot(result, path))
    summary = {key: value for key, value in result.get("answers", {}).items() if key != "rows"}
    summary.update({f"restart_{key}": value for key, value in result.get("restart", {}).items()})
    print_summary(summary, RERUN)


if __name__ == "__main__":
    main()
