"""Engine start-up against speed, per compilation setting: what a start costs and what it buys.

Not a benchmark of pipelining (the overlap of search and prefill): it measures the inference
side's engine (``specrag.pipeline``) alone, which is why it lives in this family.

Rerun: ``.venv/bin/python -m bench.pipeline.startup`` (``--configs eager,cached`` for some of
them, ``--model DIR`` for another model). Writes bench/out/startup.json and .png.

Each configuration starts the in-process engine ``--starts`` times, each start in a fresh
process (as ``specrag serve`` is), all sharing one compile cache that is empty before the first
start: the first start pays whatever compilation there is, the later ones show whether the cache
is reused. A start is timed from the process's own start to the engine's readiness. After each
start, the engine is timed on cold prefills of random ``--prefill-tokens``-token prompts and on
decoding ``--decode-tokens`` tokens. The configurations:

- ``aot``: graphs compiled, vLLM's AOT compile cache (``VLLM_USE_AOT_COMPILE=1``, vLLM's own
  default with torch 2.10 and later);
- ``cached``: graphs compiled, torch.compile's own caches (``VLLM_USE_AOT_COMPILE=0``, specrag's
  default);
- ``eager``: no graph compilation (``serve --eager``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.common import (
    add_model_option,
    bootstrap_mean_ci,
    machine,
    print_summary,
    save_figure,
    write_report,
)
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.engines.protocol import Sampling, now
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.pipeline.models.catalog import DEFAULT_MODEL_NAME, resolve_model

CONFIGS = {
    "aot": ({"VLLM_USE_AOT_COMPILE": "1"}, False),
    "cached": ({"VLLM_USE_AOT_COMPILE": "0"}, False),
    "eager": ({}, True),
}
RECOMPILED = "Compiling model again"


async def _one_start(
    model: str, eager: bool, prefill_tokens: int, decode_tokens: int, repeats: int
) -> dict[str, Any]:
    """In the child: start the engine, then time cold prefills and a decode; the figures."""
    born = psutil.Process().create_time()
    config = EngineConfig(model=model, enforce_eager=eager, startup_timeout_s=1800.0)
    engine = await VllmEngine.start(config)
    ready_s = time.time() - born
    rng = random.Random(0)
    try:
        await _first_token(engine, [11] * 64)  # the first request's one-off set-up: not measured
        prefill = []
        for _ in range(repeats):
            prompt = [rng.randrange(10, 8000) for _ in range(prefill_tokens)]
            await engine.reset_prefix_cache()
            prefill.append(await _first_token(engine, prompt))
        decode = []
        for _ in range(repeats):
            prompt = [rng.randrange(10, 8000) for _ in range(64)]
            stamps = []
            sampling = Sampling(max_tokens=decode_tokens, ignore_eos=True)
            async for output in engine.generate(uuid.uuid4().hex, prompt, sampling):
                stamps.extend([output.received_at] * len(output.token_ids))
            decode.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    finally:
        await engine.close()
    return {"ready_s": ready_s, "prefill_s": prefill, "decode_s_per_token": decode}


async def _first_token(engine: VllmEngine, prompt: list[int]) -> float:
    started = now()
    async for output in engine.generate(uuid.uuid4().hex, prompt, Sampling(max_tokens=1)):
        return output.received_at - started
    raise RuntimeError("no output")


def _child(args: argparse.Namespace) -> None:
    result = asyncio.run(
        _one_start(args.model, args.eager, args.prefill_tokens, args.decode_tokens, args.repeats)
    )
    print("RESULT " + json.dumps(result), flush=True)


def _start(config: str, cache: Path, args: argparse.Namespace, model: str) -> dict[str, Any]:
    """One start of ``config`` in a fresh process; its figures and whether it compiled again."""
    environment, eager = CONFIGS[config]
    env = {
        **os.environ,
        **environment,
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
    }
    command = [sys.executable, "-m", "bench.pipeline.startup", "--child", "--model", model]
    command += ["--prefill-tokens", str(args.prefill_tokens), "--decode-tokens", str(args.decode_tokens)]
    command += ["--repeats", str(args.repeats), *(["--eager"] if eager else [])]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600, check=False)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"{config}: the start failed:\n{run.stderr[-3000:]}")
    figures: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    figures["recompiled"] = RECOMPILED in run.stdout + run.stderr
    return figures


def _summarise(starts: list[dict[str, Any]], rng: np.random.Generator) -> dict[str, Any]:
    later = starts[1:] or starts
    prefill = np.array([value for start in starts for value in start["prefill_s"]])
    decode = np.array([value for start in starts for value in start["decode_s_per_token"]])
    return {
        "first_ready_s": starts[0]["ready_s"],
        "later_ready_s": [start["ready_s"] for start in later],
        "later_ready_s_median": statistics.median(start["ready_s"] for start in later),
        "recompiled_on_later_starts": any(start["recompiled"] for start in later),
        "prefill_s_median": float(np.median(prefill)),
        "prefill_s_mean_ci": bootstrap_mean_ci(prefill, rng),
        "decode_ms_per_token_median": float(np.median(decode)) * 1000,
        "decode_ms_per_token_mean_ci": [value * 1000 for value in bootstrap_mean_ci(decode, rng)],
        "starts": starts,
    }


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    names = list(results)
    figure, (starts, speed) = plt.subplots(1, 2, figsize=(10, 4))
    positions = np.arange(len(names))
    starts.bar(positions - 0.2, [results[n]["first_ready_s"] for n in names], 0.4, label="first start")
    later = [results[name]["later_ready_s_median"] for name in names]
    starts.bar(positions + 0.2, later, 0.4, label="later starts")
    starts.set_xticks(positions, names)
    starts.set_ylabel("seconds to a ready engine")
    starts.legend()
    speed.bar(positions, [results[n]["prefill_s_median"] for n in names], 0.5)
    speed.set_xticks(positions, names)
    speed.set_ylabel("cold prefill, s (median)")
    figure.suptitle(title)
    save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_option(parser, DEFAULT_MODEL_NAME, "the model `serve` starts")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which configurations, comma-separated")
    parser.add_argument("--starts", type=int, default=2, help="starts per configuration (the first cold)")
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="prefills and decodes timed per start")
    parser.add_argument("--name", default="startup", help="the report's name in bench/out/")
    parser.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    configs = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or args.starts < 1 or args.repeats < 1:
        parser.error(f"--configs takes {', '.join(CONFIGS)}; --starts and --repeats at least 1")
    model = str(resolve_model(DataLayout(resolve_data_dir()), args.model, ()))
    rng = np.random.default_rng(0)
    results = {}
    for config in configs:
        with tempfile.TemporaryDirectory(prefix=f"startup-{config}-") as cache:
            starts = []
            for number in range(args.starts):
                starts.append(_start(config, Path(cache), args, model))
                figures = starts[-1]
                print(
                    f"{config:>6} start {number + 1}: ready {figures['ready_s']:.1f} s, "
                    f"prefill {statistics.median(figures['prefill_s']):.3f} s, decode "
                    f"{statistics.median(figures['decode_s_per_token']) * 1000:.1f} ms/token, "
                    f"recompiled {figures['recompiled']}",
                    flush=True,
                )
        results[config] = _summarise(starts, rng)
    data = {"machine": machine(), "model": model, "args": vars(args), "configs": results}
    title = f"Engine start-up and speed, {Path(model).name}, {args.prefill_tokens}-token prefill"
    json_path, png_path = write_report(args.name, data, lambda path: plot(results, path, title))
    print(f"wrote {json_path} and {png_path}")
    summary = {
        name: {
            "first_ready_s": round(result["first_ready_s"], 1),
            "later_ready_s": round(result["later_ready_s_median"], 1),
            "recompiled": result["recompiled_on_later_starts"],
            "prefill_s": round(result["prefill_s_median"], 3),
            "decode_ms_per_token": round(result["decode_ms_per_token_median"], 1),
        }
        for name, result in results.items()
    }
    print_summary(summary, rerun="bench.pipeline.startup")


if __name__ == "__main__":
    main()
