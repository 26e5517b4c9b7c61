"""The wait between two tokens of an answer on the real engine: what ``--inter-token-timeout`` bounds.

Rerun: ``.venv/bin/python -m bench.faults.token_gaps`` (about 2 minutes here, most of it vLLM's
start with graph compilation, as ``serve`` starts it; ``--eager`` skips that).

It starts the in-process vLLM engine on the embedded default model with ``serve``'s settings and
streams answers of ``--tokens`` tokens (``ignore_eos``), recording the gap between consecutive
outputs after the first, in two regimes measured in the same run:

- ``alone``: one answer at a time, nothing else in the engine: the decode step itself;
- ``beside_prefills``: one answer decoding while ``--prefills`` cold prompts of
  ``--prefill-tokens`` tokens arrive after its first token; vLLM puts their prefill chunks (up to
  512 tokens a step) into the same steps as the decode, so a step, and the gap, grows to what a
  full chunk costs: the longest a healthy stream waits for its next token.

The timeout must sit above the second regime's longest gap with room to spare (a loaded machine),
while still ending a real stall in seconds, not minutes. Output: bench/out/token_gaps.json and
token_gaps.png (the gaps of each regime over the answer's tokens), a table, and the JSON summary
as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    machine,
    plt,
    print_summary,
    random_prompt,
    run_measurement,
    save_figure,
    write_report,
)
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.protocol import Engine, Sampling
from specrag.service.run.assets import ensure_assets
from specrag.service.run.options import ServiceOptions, base_engine_config

NAME = "token_gaps"


async def stream_gaps(
    engine: Engine, prompt: Sequence[int], tokens: int, first: asyncio.Event
) -> list[float]:
    """Seconds between consecutive outputs of one answer after its first; ``first`` set at its first."""
    stamps: list[float] = []
    sampling = Sampling(max_tokens=tokens, ignore_eos=True)
    async for output in engine.generate(f"gap-{uuid.uuid4().hex}", prompt, sampling):
        if output.token_ids:
            stamps.append(output.received_at)
            first.set()
    return [later - earlier for earlier, later in itertools.pairwise(stamps)]


async def prefill(engine: Engine, prompt: Sequence[int]) -> None:
    async for _ in engine.generate(f"load-{uuid.uuid4().hex}", prompt, Sampling(max_tokens=1)):
        pass


async def beside_prefills(engine: Engine, rng: random.Random, args: argparse.Namespace) -> list[float]:
    first = asyncio.Event()
    answer = asyncio.create_task(stream_gaps(engine, random_prompt(rng, 256), args.tokens, first))
    await first.wait()
    loads = [prefill(engine, random_prompt(rng, args.prefill_tokens)) for _ in range(args.prefills)]
    await asyncio.gather(*loads)
    return await answer


def summarise(gaps: Sequence[float], rng: np.random.Generator) -> dict[str, Any]:
    values = np.array(gaps) * 1000
    picks = rng.integers(0, len(values), size=(2000, len(values)))
    low, high = np.percentile(np.median(values[picks], axis=1), [2.5, 97.5])
    return {
        "gaps": len(values),
        "median_ms": round(float(np.median(values)), 2),
        "median_ci_ms": [round(float(low), 2), round(float(high), 2)],
        "p99_ms": round(float(np.percentile(values, 99)), 2),
        "max_ms": round(float(values.max()), 2),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from specrag.pipeline.engines.vllm_engine import VllmEngine  # importing vLLM takes seconds

    assets = ensure_assets(DataLayout(resolve_data_dir(args.data_dir)), None, None)
    config = base_engine_config(assets.model_dir, ServiceOptions(eager=args.eager)).validate()
    engine = await VllmEngine.start(config)
    rng = random.Random(0)
    try:
        await stream_gaps(engine, random_prompt(rng, 256), 8, asyncio.Event())  # warm the step paths
        alone: list[float] = []
        for _ in range(args.streams):
            alone += await stream_gaps(engine, random_prompt(rng, 256), args.tokens, asyncio.Event())
        loaded: list[float] = []
        for _ in range(args.streams):
            loaded += await beside_prefills(engine, rng, args)
    finally:
        await engine.close()
    generator = np.random.default_rng(0)
    return {
        "machine": machine(),
        "model": Path(assets.model_dir).name,
        "eager": args.eager,
        "settings": {key: getattr(args, key) for key in ("tokens", "streams", "prefills", "prefill_tokens")},
        "regimes": {"alone": summarise(alone, generator), "beside_prefills": summarise(loaded, generator)},
        "raw_ms": {"alone": [g * 1000 for g in alone], "beside_prefills": [g * 1000 for g in loaded]},
    }


def draw(result: dict[str, Any], path: Path) -> None:
    figure, axis = plt.subplots(figsize=(7, 3.5))
    for regime, gaps in result["raw_ms"].items():
        axis.plot(gaps, ".", markersize=3, label=regime)
    axis.set_yscale("log")
    axis.set_xlabel("gap (consecutive tokens, streams one after the other)")
    axis.set_ylabel("ms between tokens")
    axis.set_title(f"Token gaps, {result['model']} on {result['machine']['cpus']} CPUs")
    axis.legend()
    save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", help="data directory (default: ./data)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per answer (default %(default)s)")
    parser.add_argument("--streams", type=int, default=3, help="answers per regime (default %(default)s)")
    parser.add_argument("--prefills", type=int, default=4, help="cold prompts beside (default %(default)s)")
    parser.add_argument("--prefill-tokens", type=int, default=1500, help="their length (default %(default)s)")
    parser.add_argument("--eager", action="store_true", help="skip graph compilation (not serve's default)")
    args = parser.parse_args()
    result = run_measurement(measure(args))
    write_report(NAME, result, lambda path: draw(result, path))
    print(f"{'regime':<16} {'gaps':>5} {'median ms (95% CI)':>24} {'p99 ms':>9} {'max ms':>9}")
    for regime, figures in result["regimes"].items():
        ci = "–".join(f"{value:.1f}" for value in figures["median_ci_ms"])
        print(
            f"{regime:<16} {figures['gaps']:>5} {figures['median_ms']:>10.1f} ({ci:>11}) "
            f"{figures['p99_ms']:>9.1f} {figures['max_ms']:>9.1f}"
        )
    summary = {key: result[key] for key in ("model", "eager", "settings", "regimes")}
    print_summary(summary, rerun="bench.faults.token_gaps")


if __name__ == "__main__":
    main()
