"""Cold vs cached prefill of the engine, by prompt length: the figures docs/architecture.md quotes.

Not a benchmark of pipelining itself: the engine's prefill alone (``specrag.pipeline``), the
cost the overlap hides and the P of the ratio r = S / P that ``bench.pipeline`` sweeps.

Rerun: ``.venv/bin/python -m bench.pipeline.prefill`` (``--quick`` for fewer lengths and repeats,
``--model DIR`` for any Hugging Face model directory). Writes bench/out/prefill.json and .png.

Each length is measured cold (prefix cache reset first) and then cached (the same prompt again),
``--repeats`` times; the report gives medians and the cold/cached ratio. Also measured: the same
prompt 50 % cached, the case a speculative prefill that got half the documents right leaves behind.
The engine's model worker is pinned to one core (``--engine-cpus``), as it is in every experiment.
"""

from __future__ import annotations

import argparse
import random
import statistics
import uuid
from pathlib import Path
from typing import Any

from bench.common import (
    add_model_option,
    machine,
    print_summary,
    run_measurement,
    save_figure,
    write_report,
)
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.engines.protocol import Sampling, now
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.pipeline.models.catalog import resolve_model
from specrag.pipeline.models.random_model import RANDOM_MODEL_NAME

FULL_LENGTHS = (512, 1024, 2048, 4096, 8000)
QUICK_LENGTHS = (1024, 4096)


async def _ttft(engine: VllmEngine, prompt: list[int]) -> tuple[float, int]:
    started = now()
    async for output in engine.generate(uuid.uuid4().hex, prompt, Sampling(max_tokens=1)):
        return output.received_at - started, output.cached_tokens or 0
    raise RuntimeError("no output")


async def measure(
    engine: VllmEngine, lengths: tuple[int, ...], repeats: int, seed: int
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for length in lengths:
        cold, cached, half = [], [], []
        for _ in range(repeats):
            prompt = [rng.randrange(10, 8000) for _ in range(length)]
            await engine.reset_prefix_cache()
            cold.append((await _ttft(engine, prompt))[0])
            cached.append((await _ttft(engine, prompt))[0])
            # Same first half, new second half: the prefix cache serves about 50 %.
            variant = prompt[: length // 2] + [rng.randrange(10, 8000) for _ in range(length - length // 2)]
            half.append((await _ttft(engine, variant))[0])
        row: dict[str, Any] = {
            "tokens": length,
            "cold_s_median": statistics.median(cold),
            "cached_s_median": statistics.median(cached),
            "half_cached_s_median": statistics.median(half),
            "cold_s": cold,
            "cached_s": cached,
            "half_cached_s": half,
        }
        row["cold_over_cached"] = row["cold_s_median"] / row["cached_s_median"]
        rows.append(row)
        print(
            f"{length:>6} tokens  cold {row['cold_s_median']:.3f} s  "
            f"50% cached {row['half_cached_s_median']:.3f} s  cached {row['cached_s_median']:.3f} s  "
            f"ratio {row['cold_over_cached']:.1f}x",
            flush=True,
        )
    return rows


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    tokens = [row["tokens"] for row in rows]
    figure, axis = plt.subplots(figsize=(6, 4))
    for key, label in (
        ("cold_s_median", "cold"),
        ("half_cached_s_median", "50 % cached"),
        ("cached_s_median", "cached"),
    ):
        axis.plot(tokens, [row[key] for row in rows], marker="o", label=label)
    axis.set_xlabel("prompt tokens")
    axis.set_ylabel("time to first token (s, median)")
    axis.set_title(title)
    axis.legend()
    axis.grid(alpha=0.3)
    save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"lengths {QUICK_LENGTHS}, 2 repeats")
    add_model_option(parser, RANDOM_MODEL_NAME, "the random model's size is chosen from these figures")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per length (default 3, quick 2)")
    parser.add_argument(
        "--engine-cpus", default="0", help="cores for the engine's model worker (vLLM bind syntax)"
    )
    parser.add_argument("--eager", action="store_true", help="no graph compilation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = str(resolve_model(DataLayout(resolve_data_dir()), args.model, ()))
    lengths = QUICK_LENGTHS if args.quick else FULL_LENGTHS
    repeats = args.repeats or (2 if args.quick else 3)
    config = EngineConfig(model=model, enforce_eager=args.eager, omp_threads_bind=args.engine_cpus).validate()
    print(f"engine model worker pinned to core(s) {args.engine_cpus}; model {model}; eager={args.eager}")

    async def run() -> list[dict[str, Any]]:
        engine = await VllmEngine.start(config)
        try:
            await _ttft(engine, [11] * 64)  # first request pays one-off set-up: not measured
            return await measure(engine, lengths, repeats, args.seed)
        finally:
            await engine.close()

    rows = run_measurement(run())
    result = {
        "machine": machine(),
        "model": model,
        "engine_cpus": args.engine_cpus,
        "eager": args.eager,
        "rows": rows,
    }
    title = f"Prefill on {Path(model).name}, engine on core {args.engine_cpus}"
    json_path, png_path = write_report("prefill", result, lambda path: plot(rows, path, title))
    print(f"wrote {json_path} and {png_path}")
    summary = {f"cold_s_{r['tokens']}": round(r["cold_s_median"], 4) for r in rows}
    summary |= {f"cached_s_{r['tokens']}": round(r["cached_s_median"], 4) for r in rows}
    print_summary(summary)


if __name__ == "__main__":
    main()
