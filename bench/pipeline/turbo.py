"""TurboRAG on the in-process vLLM engine: the frontier of document KV (cold TTFT against accuracy,
for each variant and tier), the store's load time, and whether the loaded KV is right.

Not a benchmark of pipelining (the overlap of search and prefill): it measures the inference
side alone, ``specrag.pipeline``'s document KV, which shortens the prefill the overlap hides;
hence its place in this family (:mod:`bench.pipeline`).

Rerun: ``.venv/bin/python -m bench.pipeline.turbo`` (``--quick``: 2 TTFT prompts, 1 repeat, against
4 x 2, and accuracy only until the first qualifying point, fastest first; ``--questions N``, default
300; ``--concurrency N`` questions answered at once, default 8; ``--tiers 0,1`` measures those M
only; ``--model`` a model name or any Hugging Face model directory).
Writes bench/out/turbo.json and .png; the last line printed is JSON with ``frontier``, ``default``,
``cold_full_ttft_ms``, ``turbo_ttft_ms``, ``ttft_turbo_over_full`` (alone, M = 0),
``kv_rel_err_max``, ``single_doc_first_token_equal`` and ``accuracy``.

- Frontier (:mod:`bench.pipeline.turbo_frontier`): every variant (each document's KV computed
  ``alone`` or ``after-system``) and tier M = 0 … k (the top-M documents prefilled fresh, after the
  loaded ones). TTFT: prompts ``system · k documents · question`` (k = 6 passages of the corpus,
  padded to KV blocks as the service lays them out), each served cold (prefix cache reset before
  each request) in full and at every point, from a warm store; medians over prompts x repeats, the
  order of the ways rotating. No retrieval runs there: the regime is r = 0 (engine time only).
  Accuracy: :func:`~bench.pipeline.turbo_frontier.answer_frontier` answers ``bench.quality``'s
  questions through the controller as ``serial`` requests, in full and at every point (k = 6, so M
  spans the same range; 24 tokens, greedy), several questions at once, scored by
  ``bench.quality``'s ``accuracy`` (the gold name among the answer's words), each point paired with
  full prefill question by question. The default: the fastest point whose paired interval reaches
  0 with a lower end >= -0.05, or a statement that none does. ``--quick`` answers the points
  fastest first and stops at the first that qualifies (the default, by that order); the rest say
  ``accuracy: null`` and why, in the JSON and the printout.
- The engine's worker stays on one core (``--engine-cpus 0``), though nothing overlaps its prefill
  here (r = 0): vLLM's engine-core process and this process's event loop (the controller, the
  search and the scoring of the accuracy pass) run on the other, and a worker spread over both
  cores would fight them for it (one worker core is what vLLM itself picks, measured fastest in
  :mod:`specrag.pipeline.engines.config`). It is also the service's layout, the engine apart from
  the search, so the TTFT ratios are those the service sees, comparable with earlier runs.
- Store load time: reading one prompt's entries and rotating their keys, in this process (the
  connector's work apart from the cache writes, which run inside the engine's worker).
- KV error: each document of a prompt as loaded at its offset p (read back from the engine
  through the store) against a reference computation of that document alone with position ids
  starting at p (Hugging Face transformers, float32): max over layers of ||loaded - ref|| /
  ||ref||, for keys and values. The same error at p = 0 (the stored KV against the reference at
  0) is the floor that vLLM's kernels and dtype alone cause; the difference is the rotation's.
- Single document: the prompt ``document · question``, nothing before the document, served both
  ways; its first token must be the same (there the stored KV is what a full prefill computes).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import (
    add_model_option,
    bootstrap_mean_ci,
    machine,
    print_summary,
    run_measurement,
    save_figure,
    write_report,
)
from bench.pipeline.turbo_frontier import (
    ACCURACY_FLOOR,
    FULL,
    answer_frontier,
    choose_default,
    fastest_first,
    first_output,
    frontier,
    frontier_points,
    measure_ttft,
)
from bench.quality.questions import QUESTION_COUNT, build_questions
from specrag.cache.layout import PromptLayout, build_layout
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.document_kv.rope import RopeSpec
from specrag.pipeline.document_kv.store import DocumentKVStore, segment_key
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.engines.protocol import Sampling
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.pipeline.models.catalog import DEFAULT_MODEL_NAME
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.service.run.assembly import prompt_builder
from specrag.service.run.assets import ensure_assets

K = 6
QUESTIONS = (
    "How does asyncio.run create and close the event loop?",
    "What does functools.lru_cache do with keyword arguments?",
    "How do I read a file line by line with pathlib?",
    "When should I use a dataclass with frozen=True?",
    "How does contextlib.suppress work?",
    "What is the difference between list.sort and sorted?",
    "How do I parse command-line options with argparse?",
    "How does itertools.groupby group consecutive items?",
)


def store_load_seconds(store: DocumentKVStore, rope: RopeSpec, layout: PromptLayout) -> float:
    """Reading a prompt's stored entries and rotating their keys to the prompt's positions."""
    started = time.perf_counter()
    for start, end in layout.stored_spans():
        kv = store.get(segment_key(layout.token_ids[start:end]))
        if kv is None:
            raise RuntimeError("a stored span went missing during the measurement")
        rope.shift(kv[:, 0], start)
    return time.perf_counter() - started


def reference_kv(model: Any, tokens: Sequence[int], start: int) -> torch.Tensor:
    """``[layers, 2, kv_heads, tokens, head_dim]`` of ``tokens`` alone at positions start, start+1, ..."""
    ids = torch.tensor([list(tokens)])
    positions = torch.arange(start, start + len(tokens))[None, :]
    with torch.no_grad():
        cache = model(input_ids=ids, position_ids=positions, use_cache=True).past_key_values
    return torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers])


def relative_errors(actual: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """Max over layers of ||actual - reference|| / ||reference||, for keys and for values."""
    errors = {}
    for name, part in (("keys", 0), ("values", 1)):
        diff = (actual[:, part].float() - reference[:, part]).flatten(1).norm(dim=1)
        errors[name] = float((diff / reference[:, part].flatten(1).norm(dim=1)).max())
    return errors


async def kv_errors(engine: VllmEngine, layout: PromptLayout, model_dir: Path) -> dict[str, Any]:
    """Each document's KV as loaded at its offset against the reference at that offset, and the
    floor: its stored KV (offset 0) against the reference at 0."""
    from transformers import AutoModelForCausalLM

    store = engine.document_kv
    assert store is not None
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    spans = layout.stored_spans()
    await engine.reset_prefix_cache()
    whole = store.get(await engine.save_prompt_kv(layout.token_ids, spans))
    assert whole is not None
    rows: list[dict[str, Any]] = []
    for start, end in spans[1:]:  # the documents (the system prompt sits at 0: nothing to rotate)
        tokens = layout.token_ids[start:end]
        alone = store.get(segment_key(tokens))
        assert alone is not None
        loaded = relative_errors(whole[:, :, :, start:end], reference_kv(model, tokens, start))
        floor = relative_errors(alone, reference_kv(model, tokens, 0))
        rows.append({"offset": start, "tokens": end - start, "loaded": loaded, "floor": floor})
    return {
        "documents": rows,
        "max": max(max(row["loaded"].values()) for row in rows),
        "floor_max": max(max(row["floor"].values()) for row in rows),
    }


async def single_document(
    engine: VllmEngine, builder: PromptBuilder, row: int, question: str
) -> dict[str, Any]:
    """``document · question`` with nothing before the document, full and turbo: same first token?"""
    layout = build_layout(
        [],
        [(row, builder.store.tokens(row))],
        builder.question_tokens(question),
        block_size=builder.block_size,
        pad_token_id=builder.tokenizer.pad_token_id,
    )
    spans = layout.stored_spans()
    await engine.fill_document_kv(layout.span_tokens(spans))
    tokens = {}
    for way, document_kv in (("full", ()), ("turbo", spans)):
        await engine.reset_prefix_cache()
        _, cached, token = await first_output(
            engine, layout.token_ids, Sampling(max_tokens=1, document_kv=document_kv)
        )
        tokens[way] = {"first_token": token, "cached_tokens": cached}
    return {"row": row, **tokens, "equal": tokens["full"]["first_token"] == tokens["turbo"]["first_token"]}


def _ci(interval: Sequence[float]) -> str:
    return f"[{interval[0]:.3f}, {interval[1]:.3f}]"


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    rows = result["frontier"]
    for variant, marker in (("alone", "o"), ("after-system", "s")):
        mine = [row for row in rows if row["variant"] == variant and row["accuracy_diff"] is not None]
        x = [row["ttft_over_full"] for row in mine]
        if mine:
            y = [row["accuracy_diff"] for row in mine]
            low = [row["accuracy_diff"] - row["accuracy_diff_ci"][0] for row in mine]
            high = [row["accuracy_diff_ci"][1] - row["accuracy_diff"] for row in mine]
            axis.errorbar(x, y, yerr=[low, high], marker=marker, capsize=3, label=variant)
            for row in mine:
                axis.annotate(f"M={row['fresh']}", (row["ttft_over_full"], row["accuracy_diff"]), fontsize=7)
    unmeasured = [row["ttft_over_full"] for row in rows if row["accuracy_diff"] is None]
    if unmeasured:  # along the floor, below every measured interval
        lows = [row["accuracy_diff_ci"][0] for row in rows if row["accuracy_diff_ci"] is not None]
        floor = min([ACCURACY_FLOOR, *lows]) - 0.05
        axis.plot(
            unmeasured,
            [floor] * len(unmeasured),
            "x",
            color="grey",
            linestyle="none",
            label="TTFT only: accuracy not measured",
        )
    axis.axhline(0, color="grey", linewidth=0.8)
    axis.axhline(ACCURACY_FLOOR, color="red", linewidth=0.8, linestyle="--", label="lower end >= -0.05")
    chosen = result["default"]
    if chosen["name"] is not None:
        axis.axvline(
            chosen["ttft_over_full"],
            color="green",
            linewidth=0.8,
            linestyle=":",
            label=f"default {chosen['name']}",
        )
    axis.set_xscale("log")
    axis.set_xlabel("cold TTFT / full prefill's (median, k = 6; log)")
    axis.set_ylabel("accuracy − full prefill's (paired, 95 % interval)")
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize=7)
    save_figure(figure, path)


def accuracy_summary(records: Sequence[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    """Full prefill's accuracy over the questions, with its 95 % bootstrap interval."""
    if not records:
        return {"questions": 0}
    full = np.array([record[FULL]["accuracy"] for record in records], dtype=float)
    return {
        "questions": len(records),
        "full": float(full.mean()),
        "full_ci": bootstrap_mean_ci(full, np.random.default_rng(seed)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 TTFT prompts, 1 repeat (default 4 x 2); accuracy until the first qualifying point",
    )
    add_model_option(parser, DEFAULT_MODEL_NAME, "accuracy needs a real model")
    parser.add_argument(
        "--questions", type=int, default=QUESTION_COUNT, help="bench.quality questions (0: none)"
    )
    parser.add_argument("--max-tokens", type=int, default=24, help="answer length cap (as bench.quality)")
    parser.add_argument("--concurrency", type=int, default=8, help="questions answered at once (default 8)")
    parser.add_argument("--engine-cpus", default="0", help="cores for the engine's model worker")
    parser.add_argument("--eager", action="store_true", help="no graph compilation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tiers",
        type=lambda text: [int(part) for part in text.split(",")],
        help=f"measure only these M, comma-separated (a partial frontier; default 0 … {K})",
    )
    args = parser.parse_args()
    if args.concurrency < 1:
        parser.error(f"--concurrency must be at least 1, got {args.concurrency}")
    prompts, repeats = (2, 1) if args.quick else (4, 2)
    assets = ensure_assets(DataLayout(resolve_data_dir()), args.model)
    model = assets.model_dir
    questions = build_questions(assets.passages, args.questions, args.seed) if args.questions else []
    pairs = [(q.question, q.answer) for q in questions]
    points = frontier_points(K, args.tiers)

    async def run(kv_dir: str) -> dict[str, Any]:
        config = EngineConfig(
            model=str(model),
            enforce_eager=args.eager,
            omp_threads_bind=args.engine_cpus,
            document_kv_dir=kv_dir,
        )
        engine = await VllmEngine.start(config.validate())
        try:
            builder = prompt_builder(assets, engine)
            rng = random.Random(args.seed)
            chosen = [
                (rng.sample(range(len(assets.store)), K), QUESTIONS[i % len(QUESTIONS)])
                for i in range(prompts)
            ]
            layouts = [builder.build(rows, question) for rows, question in chosen]
            await first_output(engine, [11] * 64, Sampling(max_tokens=1))  # one-off set-up: not measured
            fill_started = time.perf_counter()
            segments = [t for layout in layouts for t in layout.span_tokens(layout.stored_spans())]
            filled = await engine.fill_document_kv(segments)
            fill_s = time.perf_counter() - fill_started
            ttft = await measure_ttft(engine, builder, chosen, points, repeats, engine.fill_prompt_kv)
            store = engine.document_kv
            assert store is not None
            rope = RopeSpec.from_config(json.loads((model / "config.json").read_text()))
            load_s = [store_load_seconds(store, rope, layout) for layout in layouts]
            errors = await kv_errors(engine, layouts[0], model)
            first_doc = int(layouts[0].document_ids()[0])
            single = await single_document(engine, builder, first_doc, QUESTIONS[0])
            accuracy_started = time.perf_counter()
            records = await answer_frontier(
                engine,
                builder,
                assets.index,
                pairs,
                K,
                args.max_tokens,
                fastest_first(ttft, points) if args.quick else points,
                engine.fill_prompt_kv,
                concurrency=args.concurrency,
                stop_at_first=args.quick,
            )
            return {
                "fill": {"segments": filled, "seconds": fill_s, "store_bytes": store.total_bytes()},
                "ttft": ttft,
                "store_load_s": load_s,
                "kv_error": errors,
                "single_document": single,
                "records": records,
                "accuracy_seconds": time.perf_counter() - accuracy_started,
            }
        finally:
            await engine.close()

    with tempfile.TemporaryDirectory(prefix="specrag-turbo-kv-") as kv_dir:
        result = run_measurement(run(kv_dir))
    result["frontier"] = frontier(result["ttft"], result["records"], points)
    result["default"] = choose_default(result["frontier"])
    result["accuracy"] = accuracy_summary(result["records"])
    seconds = result["ttft"]["seconds"]
    full_ms = statistics.median(seconds[FULL]) * 1000
    turbo_ms = statistics.median(seconds[points[0].name]) * 1000
    result |= {
        "machine": machine(),
        "model": str(model),
        "k": K,
        "prompts": prompts,
        "repeats": repeats,
        "concurrency": args.concurrency,
    }
    title = (
        f"Document KV frontier, k = {K}, {model.name}, {result['accuracy']['questions']} questions (r = 0)"
    )
    json_path, png_path = write_report("turbo", result, lambda path: plot(result, path, title))
    print(f"wrote {json_path} and {png_path}")
    load_ms = statistics.median(result["store_load_s"]) * 1000
    floor = result["kv_error"]["floor_max"]
    print(f"store load (read + rotate, a prompt): {load_ms:.1f} ms; KV error floor (p = 0): {floor:.4f}")
    accuracy = result["accuracy"]
    if accuracy["questions"]:
        print(
            f"full prefill: accuracy {accuracy['full']:.3f} {_ci(accuracy['full_ci'])} "
            f"on {accuracy['questions']} questions ({result['accuracy_seconds']:.0f} s, "
            f"{args.concurrency} at once)"
        )
    for row in result["frontier"]:
        line = f"{row['name']:<22} ttft/full {row['ttft_over_full']:.3f}"
        if row["accuracy_diff_ci"] is None:
            line += f"  accuracy {row['accuracy_note']}"
        else:
            line += (
                f"  accuracy {row['accuracy']:.3f}, − full {row['accuracy_diff']:+.3f} "
                f"{_ci(row['accuracy_diff_ci'])}"
            )
        print(line)
    print(f"default: {result['default']}")
    summary = {
        "frontier": [
            {
                key: row[key]
                for key in ("name", "ttft_over_full", "accuracy_diff_ci", "accuracy_note")
                if key in row
            }
            for row in result["frontier"]
        ],
        "default": result["default"],
        "cold_full_ttft_ms": round(full_ms, 2),
        "turbo_ttft_ms": round(turbo_ms, 2),
        "ttft_turbo_over_full": round(turbo_ms / full_ms, 4),
        "store_load_ms": round(load_ms, 2),
        "kv_rel_err_max": round(result["kv_error"]["max"], 5),
        "single_doc_first_token_equal": result["single_document"]["equal"],
        "accuracy": accuracy,
    }
    print_summary(summary)


if __name__ == "__main__":
    main()
