"""How much search and prefill slow each other on two cores: the limit of overlap here.

Speculative pipelining overlaps the search (on its own core) with the engine's prefill (on the
other). That gains fully only if each runs as fast beside the other as alone. Both directions:

**Search.** The same one-shot IVF searches, pinned to ``--search-cpus``, in three conditions, one
after the other:

- ``alone``: nothing else runs on purpose;
- ``beside_matmul``: a single-threaded numpy matrix multiplication loops in a process pinned to
  ``--engine-cpus`` (pure compute, no vLLM);
- ``beside_prefill``: vLLM (engine core and model worker pinned to ``--engine-cpus``) prefills
  prompts of random tokens back to back, so nothing is served from its prefix cache.

**Prefill.** The same prompts' time to first token (prefills of ``--prefill-tokens`` random
tokens, each from an emptied prefix cache), ``prefill_alone`` and then ``prefill_beside_<kind>``
for each index of ``--scan-indexes`` while its searches (the same probe share) loop back to back
on the search core. A scan streams its lists from memory, and on a machine whose cores share
memory bandwidth and last-level cache that slows the other core too: flat lists stream four times
the bytes of SQ8 ones.

Each condition reports its median, p99 and ratio to its ``alone``. Rerun:
``.venv/bin/python -m bench.pipeline.contention [--quick]`` (about 4 minutes; it reuses the padded indexes
``bench.pipeline --quick`` builds). Writes bench/out/contention.json and contention.png; the last
line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    machine,
    pin_apart,
    print_summary,
    random_prompt,
    run_measurement,
    save_figure,
    write_report,
)
from bench.e2e.runner import search_times_ms, set_search_ratio, ttft_of
from bench.indexes import scaled_index
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.config import parse_cpus
from specrag.pipeline.engines.protocol import Engine, Sampling
from specrag.pipeline.models.random_model import RANDOM_MODEL_NAME
from specrag.retrieval.index_store import IVF_KINDS
from specrag.retrieval.search.search_runner import SearchRunner
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assembly import ServiceOptions, open_engine
from specrag.service.run.assets import ensure_assets

# A single-threaded matrix multiplication, forever: compute on one core and nothing else.
MATMUL_LOOP = (
    "import numpy as np\n"
    "a = np.random.default_rng(0).random((512, 512))\n"
    "while True:\n"
    "    a = (a @ a) / 512\n"
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pipeline.contention", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer searches")
    parser.add_argument(
        "--index-size", type=int, default=1_000_000, help="vectors in the padded index of the search part"
    )
    parser.add_argument("--nlist", type=int, default=1024, help="IVF lists of the padded index")
    parser.add_argument("--ratio", type=float, default=0.5, help="share of the IVF lists probed")
    parser.add_argument(
        "--prompt-tokens", type=int, default=1536, help="tokens of each prefill beside the searches"
    )
    parser.add_argument("--prefill-tokens", type=int, default=450, help="tokens of each timed prefill")
    parser.add_argument(
        "--scan-indexes",
        default="ivf:4000000,ivf-sq8:8000000",
        help="KIND:VECTORS,... padded IVF indexes whose searches loop beside the timed prefills",
    )
    parser.add_argument("--engine-cpus", default="0", help="core(s) of the engine / the matmul")
    parser.add_argument("--search-cpus", default="1", help="core(s) of the vector search thread")
    args = parser.parse_args()
    args.searches = 30 if args.quick else 100
    args.prefills = 10 if args.quick else 30
    try:
        args.scan_indexes = [
            (kind, int(size)) for kind, size in (p.split(":") for p in args.scan_indexes.split(","))
        ]
    except ValueError:
        parser.error("--scan-indexes takes KIND:VECTORS pairs separated by commas, e.g. ivf:4000000")
    for kind, _ in args.scan_indexes:
        if kind not in IVF_KINDS:
            parser.error(f"--scan-indexes: {kind} is not an IVF kind ({', '.join(IVF_KINDS)})")
    return args


@contextlib.contextmanager
def matmul_on(cores: frozenset[int]) -> Any:
    """The matmul loop in its own single-threaded process, pinned to ``cores``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", MATMUL_LOOP], env=env)
    try:
        os.sched_setaffinity(process.pid, cores)
        yield
    finally:
        process.kill()
        process.wait()


@contextlib.asynccontextmanager
async def looping(step: Callable[[int], Awaitable[None]], settle_s: float) -> AsyncIterator[list[int]]:
    """``step(n)`` back to back in a task while the block runs, from ``settle_s`` after it starts
    (the first step is under way); yields the list that counts the steps done."""
    done: list[int] = []

    async def loop() -> None:
        while True:
            await step(len(done))
            done.append(1)

    task = asyncio.create_task(loop())
    await asyncio.sleep(settle_s)
    try:
        yield done
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def prefills_on(engine: Engine, prompt_tokens: int) -> contextlib.AbstractAsyncContextManager[list[int]]:
    """Cold prefills of random prompts back to back while the block runs; yields their count."""
    rng = random.Random(0)

    async def prefill(n: int) -> None:
        async for _ in engine.generate(f"hog-{n}", random_prompt(rng, prompt_tokens), Sampling(max_tokens=1)):
            pass

    return looping(prefill, settle_s=0.5)


def searches_on(index: VectorIndex, vectors: np.ndarray) -> contextlib.AbstractAsyncContextManager[list[int]]:
    """One-shot searches back to back on the index's (pinned) search runner; yields their count."""

    async def search(n: int) -> None:
        row = n % len(vectors)
        await search_times_ms(index, vectors[row : row + 1], k=10)

    return looping(search, settle_s=0.3)


def random_prompts(count: int, tokens: int) -> list[list[int]]:
    rng = random.Random(1)
    return [random_prompt(rng, tokens) for _ in range(count)]


async def ttfts_ms(engine: Engine, prompts: list[list[int]]) -> list[float]:
    """Each prompt's time to first token, one at a time, from an emptied prefix cache."""
    timings = []
    for prompt in prompts:
        await engine.reset_prefix_cache()
        timings.append(await ttft_of(engine, prompt) * 1000)
    return timings


def describe(timings: list[float], alone: list[float] | None) -> dict[str, Any]:
    ordered = sorted(timings)
    median = statistics.median(ordered)
    result: dict[str, Any] = {
        "count": len(ordered),
        "median_ms": round(median, 2),
        "p99_ms": round(ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))], 2),
    }
    if alone is not None:
        result["median_over_alone"] = round(median / statistics.median(alone), 3)
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = DataLayout(resolve_data_dir())
    assets = ensure_assets(layout, RANDOM_MODEL_NAME)
    index = scaled_index(layout, assets, args.index_size, args.nlist)
    runner = SearchRunner(threads=1, cpus=parse_cpus(args.search_cpus, "--search-cpus"))
    scan_indexes = {
        kind: scaled_index(layout, assets, size, args.nlist, kind) for kind, size in args.scan_indexes
    }
    nprobe = set_search_ratio(index, args.ratio)
    index.use_runner(runner)
    for scanned in scan_indexes.values():  # as many lists as the index: the same nprobe
        set_search_ratio(scanned, args.ratio)
        scanned.use_runner(runner)
    rng = np.random.default_rng(7)
    picks = rng.integers(0, len(assets.passages), args.searches)
    vectors = np.stack([index.embed_query(assets.passages[int(i)].text[:120]) for i in picks])
    engine_cores = parse_cpus(args.engine_cpus, "--engine-cpus")
    conditions: dict[str, list[float]] = {}

    async def measure() -> list[float]:
        return await search_times_ms(index, vectors, k=10)

    try:
        await measure()  # warm the index's pages and the runner
        for scanned in scan_indexes.values():
            await search_times_ms(scanned, vectors, k=10)  # bring its probed lists in
        conditions["alone"] = await measure()
        with matmul_on(engine_cores):
            await asyncio.sleep(0.5)
            conditions["beside_matmul"] = await measure()
        options = ServiceOptions(engine_cpus=args.engine_cpus)
        async with open_engine(assets.model_dir, options, layout.root / "run" / "contention") as (engine, _):
            pinned = pin_apart(engine_cores, parse_cpus(args.search_cpus, "--search-cpus"))
            print(f"pinned to core(s) {args.engine_cpus}: {', '.join(pinned)}", flush=True)
            async with prefills_on(engine, args.prompt_tokens) as prefills:
                conditions["beside_prefill"] = await measure()
            print(f"{len(prefills)} prefills of {args.prompt_tokens} random tokens ran meanwhile", flush=True)
            prefill_conditions = await prefill_part(engine, scan_indexes, vectors, args)
    finally:
        runner.shutdown()
    summary = {
        "search": summarize(conditions, "alone"),
        "prefill": summarize(prefill_conditions, "prefill_alone"),
    }
    facts = {
        **machine(),
        "index": {"vectors": args.index_size, "nlist": args.nlist, "nprobe": nprobe, "dim": index.dim},
        "scan_indexes": {kind: size for kind, size in args.scan_indexes},
        "search_cpus": args.search_cpus,
        "engine_cpus": args.engine_cpus,
        "prompt_tokens": args.prompt_tokens,
        "prefill_tokens": args.prefill_tokens,
    }
    timings = {"search": conditions, "prefill": prefill_conditions}
    report = {"facts": facts, "summary": summary, "timings_ms": timings}
    write_report("contention", report, lambda path: plot(timings, path))
    return summary


def summarize(conditions: dict[str, list[float]], alone: str) -> dict[str, dict[str, Any]]:
    return {name: describe(t, None if name == alone else conditions[alone]) for name, t in conditions.items()}


async def prefill_part(
    engine: Engine, scan_indexes: dict[str, VectorIndex], vectors: np.ndarray, args: argparse.Namespace
) -> dict[str, list[float]]:
    """The same prompts' TTFT alone and beside each index's searches looping on the search core."""
    prompts = random_prompts(args.prefills, args.prefill_tokens)
    await ttfts_ms(engine, prompts[:2])  # warm-up, not measured
    conditions = {"prefill_alone": await ttfts_ms(engine, prompts)}
    for kind, scanned in scan_indexes.items():
        async with searches_on(scanned, vectors) as searches:
            conditions[f"prefill_beside_{kind}"] = await ttfts_ms(engine, prompts)
        print(f"{sum(searches)} searches of the {kind} index ran meanwhile", flush=True)
    return conditions


def plot(timings: dict[str, dict[str, list[float]]], path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, (searches, prefills) = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = {
        "search": ("one IVF search (ms), search core pinned", "The same searches beside the other core"),
        "prefill": ("time to first token (ms), engine core pinned", "The same prefills beside searches"),
    }
    for axis, (part, conditions) in zip((searches, prefills), timings.items(), strict=True):
        axis.boxplot(list(conditions.values()), showfliers=True)
        axis.set_xticks(range(1, len(conditions) + 1), list(conditions), rotation=15, fontsize=8)
        axis.set(ylabel=labels[part][0], title=labels[part][1])
    save_figure(figure, path)


def main() -> None:
    args = parse_args()
    summary = run_measurement(run(args))
    for part, conditions in summary.items():
        for name, figures in conditions.items():
            print(f"{part:8s} {name:24s} {figures}")
    print(f"pinning: search on core(s) {args.search_cpus}, matmul / engine on core(s) {args.engine_cpus}")
    print_summary(summary, "bench.pipeline.contention [--quick]")


if __name__ == "__main__":
    main()
