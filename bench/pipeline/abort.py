"""What a wrong speculation costs the one that replaces it, by the engine's step budget.

When a stage's running top-k changes, the controller aborts the live speculation and submits a
new one. vLLM applies an abort only between steps, and its scheduler caps a prefill's step at
``long_prefill_token_threshold`` only when another request is eligible too: a lone speculation
prefills up to ``max_num_batched_tokens`` (512 by default here) in one step. So the replacement
waits for the whole stale prefill unless the step budget itself is smaller, and a smaller budget
slows every prefill.

For each budget in ``--budgets`` (the threshold is the smaller of 256 and the budget) one engine
starts, pinned to ``--engine-cpus`` (this process to ``--search-cpus``), and measures:

- ``cold_ttft_ms``: a prompt of ``--prompt-tokens`` random tokens from an emptied prefix cache;
- ``replacement_wait_ms``: such a prompt is submitted, aborted ``--abort-after-ms`` later, and a
  second one submitted at once; the figure is from that submission to the engine scheduling the
  second (vLLM's own ``scheduled_ts``).

Medians and maxima over ``--repeats`` tries. Rerun: ``.venv/bin/python -m bench.pipeline.abort [--quick]``
(about 3 minutes: one engine start per budget). Writes bench/out/abort.json and abort.png; the
last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import (
    machine,
    pin_apart,
    print_summary,
    random_prompt,
    run_measurement,
    save_figure,
    write_report,
)
from bench.e2e.runner import ttft_of
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.config import EngineConfig, parse_cpus
from specrag.pipeline.engines.protocol import Engine, Sampling
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.pipeline.models.random_model import RANDOM_MODEL_NAME
from specrag.service.run.assets import ensure_assets

DEFAULT_THRESHOLD = 256


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pipeline.abort", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer tries per budget")
    parser.add_argument("--budgets", default="512,256,128", help="max_num_batched_tokens values to compare")
    parser.add_argument("--prompt-tokens", type=int, default=240, help="tokens of each prompt (one passage)")
    parser.add_argument("--abort-after-ms", type=float, default=8.0, help="delay before the abort")
    parser.add_argument("--engine-cpus", default="0", help="core(s) of the engine")
    parser.add_argument("--search-cpus", default="1", help="core(s) of this process")
    args = parser.parse_args()
    args.repeats = 6 if args.quick else 15
    try:
        args.budgets = [int(budget) for budget in args.budgets.split(",")]
    except ValueError:
        parser.error("--budgets takes token counts separated by commas, e.g. 512,128")
    if min(args.budgets) < 1 or args.prompt_tokens < 1:
        parser.error("budgets and --prompt-tokens must be positive")
    return args


async def first_output(engine: Engine, request_id: str, prompt: list[int]) -> Any:
    async for output in engine.generate(request_id, prompt, Sampling(max_tokens=1)):
        return output
    raise RuntimeError(f"{request_id} produced no output")


async def measure(engine: Engine, args: argparse.Namespace) -> dict[str, list[float]]:
    rng = random.Random(0)

    def prompt() -> list[int]:
        return random_prompt(rng, args.prompt_tokens)

    await ttft_of(engine, prompt())  # warm-up, not measured
    cold = []
    for _ in range(args.repeats):
        await engine.reset_prefix_cache()
        cold.append(await ttft_of(engine, prompt()) * 1000)
    waits = []
    for attempt in range(args.repeats):
        await engine.reset_prefix_cache()
        stale = asyncio.create_task(first_output(engine, f"stale-{attempt}", prompt()))
        await asyncio.sleep(args.abort_after_ms / 1000)
        await engine.abort(f"stale-{attempt}")
        submitted = time.perf_counter()
        output = await first_output(engine, f"replacement-{attempt}", prompt())
        waits.append((output.scheduled_at - submitted) * 1000)
        stale.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await stale
    return {"cold_ttft_ms": cold, "replacement_wait_ms": waits}


def describe(timings: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(timings), 1), "max": round(max(timings), 1)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = DataLayout(resolve_data_dir())
    assets = ensure_assets(layout, RANDOM_MODEL_NAME)
    results = {}
    for budget in args.budgets:
        config = EngineConfig(
            model=str(assets.model_dir),
            omp_threads_bind=args.engine_cpus,
            max_num_batched_tokens=budget,
            long_prefill_token_threshold=min(DEFAULT_THRESHOLD, budget),
        )
        engine = await VllmEngine.start(config)
        try:
            pin_apart(
                parse_cpus(args.engine_cpus, "--engine-cpus"), parse_cpus(args.search_cpus, "--search-cpus")
            )
            timings = await measure(engine, args)
        finally:
            await engine.close()
        results[budget] = {name: describe(values) for name, values in timings.items()}
        print(f"budget {budget}: {results[budget]}", flush=True)
    facts = {**machine(), **{k: v for k, v in vars(args).items() if k != "quick"}}
    by_budget = {str(b): r for b, r in results.items()}
    write_report("abort", {"facts": facts, "by_budget": by_budget}, lambda path: plot(results, path))
    return {str(budget): result for budget, result in results.items()}


def plot(results: dict[int, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    budgets = list(results)
    width = 0.4
    for offset, name in ((-width / 2, "cold_ttft_ms"), (width / 2, "replacement_wait_ms")):
        axis.bar(
            [i + offset for i in range(len(budgets))],
            [results[b][name]["median"] for b in budgets],
            width,
            label=name,
        )
    axis.set_xticks(range(len(budgets)), [str(b) for b in budgets])
    axis.set(xlabel="max_num_batched_tokens (engine step budget)", ylabel="median (ms)")
    axis.set_title("A lone speculation's step: prefill time and what an abort leaves to wait")
    axis.legend(fontsize=8)
    save_figure(figure, path)


def main() -> None:
    args = parse_args()
    summary = run_measurement(run(args))
    print(f"pinning: engine on core(s) {args.engine_cpus}, this process on core(s) {args.search_cpus}")
    print_summary(summary, "bench.pipeline.abort [--quick]")


if __name__ == "__main__":
    main()
