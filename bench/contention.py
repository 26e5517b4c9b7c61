"""How much a vector search slows down while the other core computes: the limit of overlap here.

Speculative pipelining overlaps the search (on its own core) with the engine's prefill (on the
other). That gains only if the search runs as fast beside a prefill as alone. This measures the
same one-shot IVF searches, pinned to ``--search-cpus``, in three conditions, one after the other:

- ``alone``: nothing else runs on purpose;
- ``beside_matmul``: a single-threaded numpy matrix multiplication loops in a process pinned to
  ``--engine-cpus`` (pure compute, no vLLM);
- ``beside_prefill``: vLLM (engine core and model worker pinned to ``--engine-cpus``) prefills
  prompts of random tokens back to back, so nothing is served from its prefix cache.

Each reports the median and p99 search time and its ratio to ``alone``. Rerun:
``.venv/bin/python -m bench.contention [--quick]`` (about 3 minutes; it reuses the padded index
``bench.pipeline --quick`` builds). Writes bench/out/contention.json and contention.png; the last
line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import machine, pin_apart, plot_path, stop_cleanly_on_sigterm, write_json
from bench.e2e.__main__ import cpus, scaled_index
from bench.e2e.runner import search_times_ms, set_search_ratio
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engine import Engine, Sampling
from specrag.retrieval.search_runner import SearchRunner
from specrag.service.assembly import ServiceOptions, open_engine
from specrag.service.assets import ensure_assets

# Prefill prompts draw their tokens from these IDs (any model's vocabulary is larger).
RANDOM_TOKEN_IDS = 1000

# A single-threaded matrix multiplication, forever: compute on one core and nothing else.
MATMUL_LOOP = (
    "import numpy as np\n"
    "a = np.random.default_rng(0).random((512, 512))\n"
    "while True:\n"
    "    a = (a @ a) / 512\n"
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.contention", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer searches")
    parser.add_argument("--index-size", type=int, default=1_000_000, help="vectors in the padded index")
    parser.add_argument("--nlist", type=int, default=1024, help="IVF lists of the padded index")
    parser.add_argument("--ratio", type=float, default=0.5, help="share of the IVF lists probed")
    parser.add_argument("--prompt-tokens", type=int, default=1536, help="tokens of each prefill")
    parser.add_argument("--engine-cpus", default="0", help="core(s) of the engine / the matmul")
    parser.add_argument("--search-cpus", default="1", help="core(s) of the vector search thread")
    args = parser.parse_args()
    args.searches = 30 if args.quick else 100
    return args


@contextlib.contextmanager
def matmul_on(cores: set[int]) -> Any:
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
async def prefills_on(engine: Engine, prompt_tokens: int) -> AsyncIterator[list[int]]:
    """Cold prefills of random prompts back to back while the block runs; yields their count."""
    done: list[int] = []
    rng = random.Random(0)

    async def loop() -> None:
        while True:
            prompt = [rng.randrange(3, RANDOM_TOKEN_IDS) for _ in range(prompt_tokens)]
            async for _ in engine.generate(f"hog-{len(done)}", prompt, Sampling(max_tokens=1)):
                pass
            done.append(1)

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.5)  # the first prefill is under way
    try:
        yield done
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def describe(timings: list[float], alone: list[float] | None) -> dict[str, Any]:
    ordered = sorted(timings)
    median = statistics.median(ordered)
    result: dict[str, Any] = {
        "searches": len(ordered),
        "median_ms": round(median, 2),
        "p99_ms": round(ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))], 2),
    }
    if alone is not None:
        result["median_over_alone"] = round(median / statistics.median(alone), 3)
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = DataLayout(resolve_data_dir())
    assets = ensure_assets(layout, None)
    index = scaled_index(layout, assets, args.index_size, args.nlist)
    index.use_runner(SearchRunner(threads=1, cpus=cpus(args.search_cpus)))
    nprobe = set_search_ratio(index, args.ratio)
    rng = np.random.default_rng(7)
    picks = rng.integers(0, len(assets.passages), args.searches)
    vectors = np.stack([index.embed_query(assets.passages[int(i)].text[:120]) for i in picks])
    engine_cores = cpus(args.engine_cpus)
    conditions: dict[str, list[float]] = {}

    async def measure() -> list[float]:
        return await search_times_ms(index, vectors, k=10)

    try:
        await measure()  # warm the index's pages and the runner
        conditions["alone"] = await measure()
        with matmul_on(engine_cores):
            await asyncio.sleep(0.5)
            conditions["beside_matmul"] = await measure()
        options = ServiceOptions(omp_threads_bind=args.engine_cpus)
        async with open_engine(assets.model_dir, options, layout.root / "run" / "contention") as (engine, _):
            pinned = pin_apart(engine_cores, cpus(args.search_cpus))
            print(f"pinned to core(s) {args.engine_cpus}: {', '.join(pinned)}", flush=True)
            async with prefills_on(engine, args.prompt_tokens) as prefills:
                conditions["beside_prefill"] = await measure()
            print(f"{len(prefills)} prefills of {args.prompt_tokens} random tokens ran meanwhile", flush=True)
    finally:
        index.runner.shutdown()
    alone = conditions["alone"]
    summary = {name: describe(t, None if name == "alone" else alone) for name, t in conditions.items()}
    facts = {
        **machine(),
        "index": {"vectors": args.index_size, "nlist": args.nlist, "nprobe": nprobe, "dim": index.dim},
        "search_cpus": args.search_cpus,
        "engine_cpus": args.engine_cpus,
        "prompt_tokens": args.prompt_tokens,
    }
    write_json("contention", {"facts": facts, "summary": summary, "timings_ms": conditions})
    plot(conditions, plot_path("contention"))
    return summary


def plot(conditions: dict[str, list[float]], path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    axis.boxplot(list(conditions.values()), showfliers=True)
    axis.set_xticks(range(1, len(conditions) + 1), list(conditions))
    axis.set_ylabel("one IVF search (ms), search core pinned")
    axis.set_title("The same searches alone and beside compute on the other core")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    stop_cleanly_on_sigterm()
    args = parse_args()
    summary = asyncio.run(run(args))
    for name, figures in summary.items():
        print(f"{name:16s} {figures}")
    print(f"pinning: search on core(s) {args.search_cpus}, matmul / engine on core(s) {args.engine_cpus}")
    print("rerun: .venv/bin/python -m bench.contention [--quick]")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
