"""TurboRAG on the in-process vLLM engine: cold TTFT of full prefill against document KV loaded
from the store, the store's load time, and whether the loaded KV is right.

Not a benchmark of pipelining (the overlap of search and prefill): it measures the inference
side alone, ``specrag.pipeline``'s document KV, which shortens the prefill the overlap hides;
hence its place in this family (:mod:`bench.pipeline`).

Rerun: ``.venv/bin/python -m bench.pipeline.turbo`` (``--quick``: fewer TTFT prompts and repeats; ``--model``
a model name or any Hugging Face model directory). Writes bench/out/turbo.json and .png; the last line printed
is JSON with ``cold_full_ttft_ms``, ``turbo_ttft_ms``, ``ttft_turbo_over_full``, ``kv_rel_err_max``,
``single_doc_first_token_equal`` and ``accuracy``.

- TTFT: prompts ``system · k documents · question`` (k = 6 passages of the corpus, padded to KV
  blocks as the service lays them out). Each is served cold both ways, prefix cache reset before
  each: a full prefill, and turbo (the system prompt's and the documents' KV loaded from the warm
  store, only the question prefilled). Medians over prompts x repeats; the two ways alternate.
  No retrieval runs here: the regime is r = 0 (engine time only).
- Store load time: reading one prompt's entries and rotating their keys, in this process (the
  connector's work apart from the cache writes, which run inside the engine's worker).
- KV error: each document of a prompt as loaded at its offset p (read back from the engine
  through the store) against a reference computation of that document alone with position ids
  starting at p (Hugging Face transformers, float32): max over layers of ||loaded - ref|| /
  ||ref||, for keys and values. The same error at p = 0 (the stored KV against the reference at
  0) is the floor that vLLM's kernels and dtype alone cause; the difference is the rotation's.
- Single document: the prompt ``document · question``, nothing before the document, served both
  ways; its first token must be the same (there the stored KV is what a full prefill computes).
- Accuracy: :func:`answer_accuracy` answers ``bench.quality``'s questions (``--questions N``,
  default 104; 0 skips it) through the controller as ``serial`` requests both ways, k = 4 and 24
  tokens as ``bench.quality`` does, and scores them with its metrics (``accuracy``: the gold name
  is among the answer's words).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import uuid
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
from bench.quality.questions import build_questions, score
from specrag.cache.layout import PromptLayout, build_layout
from specrag.controller.controller import ControllerConfig, RagRequest
from specrag.controller.modes import ModeName
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.document_kv.rope import RopeSpec
from specrag.pipeline.document_kv.store import DocumentKVStore, segment_key
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.engines.protocol import Sampling, now
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.pipeline.models.catalog import DEFAULT_MODEL_NAME
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assembly import open_controller, prompt_builder
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


async def first_output(
    engine: VllmEngine, prompt: Sequence[int], sampling: Sampling
) -> tuple[float, int, int]:
    """(seconds to the first token, cached tokens, first token) of one request."""
    started = now()
    async for output in engine.generate(uuid.uuid4().hex, prompt, sampling):
        if output.token_ids:
            return output.received_at - started, output.cached_tokens or 0, output.token_ids[0]
    raise RuntimeError("the engine returned no token")


async def measure_ttft(engine: VllmEngine, layouts: Sequence[PromptLayout], repeats: int) -> dict[str, Any]:
    """Cold TTFT of every prompt both ways, prefix cache reset before each request."""
    full: list[float] = []
    turbo: list[float] = []
    loaded: list[int] = []
    for repeat in range(repeats):
        for index, layout in enumerate(layouts):
            spans = layout.stored_spans()
            ways = [("full", ()), ("turbo", spans)]
            if (repeat + index) % 2:
                ways.reverse()
            for way, document_kv in ways:
                await engine.reset_prefix_cache()
                sampling = Sampling(max_tokens=1, document_kv=document_kv)
                seconds, cached, _ = await first_output(engine, layout.token_ids, sampling)
                (full if way == "full" else turbo).append(seconds)
                if way == "turbo":
                    loaded.append(cached)
    return {
        "full_s": full,
        "turbo_s": turbo,
        "turbo_loaded_tokens": loaded,
        "prompt_tokens": [len(layout.token_ids) for layout in layouts],
        "stored_tokens": [layout.stored_spans()[-1][1] for layout in layouts],
    }


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


async def answer_accuracy(
    engine: VllmEngine,
    builder: PromptBuilder,
    index: VectorIndex,
    pairs: Sequence[tuple[str, str]],
    k: int,
    max_tokens: int,
) -> dict[str, Any]:
    """The accuracy hook: (question, gold answer) pairs answered through the controller, full
    against turbo, scored by ``bench.quality``'s metrics.

    Both ways run as ``serial`` requests (search, then one prompt, documents in retrieval order:
    the same prompt both ways) with greedy decoding. Before the turbo request, its segments are
    filled into the store, so it loads every document instead of falling back to a full prefill
    on first use (``loaded_tokens`` says what it loaded).
    """
    sums = {way: {"accuracy": 0.0, "f1": 0.0} for way in ("full", "turbo")}
    identical = loaded = 0
    records = []
    config = ControllerConfig(mode=ModeName.SERIAL)
    async with open_controller(engine, None, index, builder, config) as (controller, _):
        for question, gold in pairs:
            full = await controller.answer(
                RagRequest(question, k=k, max_tokens=max_tokens, document_kv="full")
            )
            spans = full.prompt.stored_spans()
            await engine.fill_document_kv(full.prompt.span_tokens(spans))
            turbo = await controller.answer(
                RagRequest(question, k=k, max_tokens=max_tokens, document_kv="turbo")
            )
            loaded += turbo.timeline.document_kv_tokens
            identical += full.text == turbo.text
            record: dict[str, Any] = {"question": question, "gold": gold}
            for way, done in (("full", full), ("turbo", turbo)):
                scores = score(done.text, gold)
                for metric in sums[way]:
                    sums[way][metric] += scores[metric]
                record[way] = {"answer": done.text, **scores}
            records.append(record)
    n = len(pairs)
    return {
        "questions": n,
        "full": sums["full"]["accuracy"] / n if n else None,
        "turbo": sums["turbo"]["accuracy"] / n if n else None,
        **accuracy_intervals(records),
        "f1": {way: sums[way]["f1"] / n for way in sums} if n else None,
        "identical_answers": identical / n if n else None,
        "turbo_loaded_tokens_mean": loaded / n if n else None,
        "records": records,
    }


def _ci(interval: Sequence[float]) -> str:
    return f"[{interval[0]:.3f}, {interval[1]:.3f}]"


def accuracy_intervals(records: Sequence[dict[str, Any]], seed: int = 0) -> dict[str, list[float]]:
    """95 % bootstrap intervals of each way's accuracy and of the paired difference turbo − full."""
    if not records:
        return {}
    rng = np.random.default_rng(seed)
    full = np.array([r["full"]["accuracy"] for r in records])
    turbo = np.array([r["turbo"]["accuracy"] for r in records])
    return {
        "full_ci": bootstrap_mean_ci(full, rng),
        "turbo_ci": bootstrap_mean_ci(turbo, rng),
        "delta_ci": bootstrap_mean_ci(turbo - full, rng),
    }


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    ttft = result["ttft"]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.boxplot([[s * 1000 for s in ttft["full_s"]], [s * 1000 for s in ttft["turbo_s"]]])
    axis.set_xticks([1, 2], ["full prefill (cold)", "turbo (store warm)"])
    axis.set_ylabel("time to first token (ms)")
    axis.set_title(title, fontsize=9)
    save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 TTFT prompts, 2 repeats (default 8 x 3)")
    add_model_option(parser, DEFAULT_MODEL_NAME, "accuracy needs a real model")
    parser.add_argument("--questions", type=int, default=104, help="bench.quality questions (0: none)")
    parser.add_argument(
        "-k", type=int, default=4, help="passages per question for accuracy (as bench.quality)"
    )
    parser.add_argument("--max-tokens", type=int, default=24, help="answer length cap (as bench.quality)")
    parser.add_argument("--engine-cpus", default="0", help="cores for the engine's model worker")
    parser.add_argument("--eager", action="store_true", help="no graph compilation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts, repeats = (4, 2) if args.quick else (8, 3)
    assets = ensure_assets(DataLayout(resolve_data_dir()), args.model)
    model = assets.model_dir
    questions = build_questions(assets.passages, args.questions, args.seed) if args.questions else []
    pairs = [(q.question, q.answer) for q in questions]

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
            layouts = [
                builder.build(rng.sample(range(len(assets.store)), K), QUESTIONS[i % len(QUESTIONS)])
                for i in range(prompts)
            ]
            await first_output(engine, [11] * 64, Sampling(max_tokens=1))  # one-off set-up: not measured
            fill_started = time.perf_counter()
            segments = [t for layout in layouts for t in layout.span_tokens(layout.stored_spans())]
            filled = await engine.fill_document_kv(segments)
            fill_s = time.perf_counter() - fill_started
            ttft = await measure_ttft(engine, layouts, repeats)
            store = engine.document_kv
            assert store is not None
            rope = RopeSpec.from_config(json.loads((model / "config.json").read_text()))
            load_s = [store_load_seconds(store, rope, layout) for layout in layouts]
            errors = await kv_errors(engine, layouts[0], model)
            first_doc = int(layouts[0].document_ids()[0])
            single = await single_document(engine, builder, first_doc, QUESTIONS[0])
            accuracy = await answer_accuracy(engine, builder, assets.index, pairs, args.k, args.max_tokens)
            return {
                "fill": {"segments": filled, "seconds": fill_s, "store_bytes": store.total_bytes()},
                "ttft": ttft,
                "store_load_s": load_s,
                "kv_error": errors,
                "single_document": single,
                "accuracy": accuracy,
            }
        finally:
            await engine.close()

    with tempfile.TemporaryDirectory(prefix="specrag-turbo-kv-") as kv_dir:
        result = run_measurement(run(kv_dir))
    full_ms = statistics.median(result["ttft"]["full_s"]) * 1000
    turbo_ms = statistics.median(result["ttft"]["turbo_s"]) * 1000
    result |= {"machine": machine(), "model": str(model), "k": K, "prompts": prompts, "repeats": repeats}
    title = f"Cold TTFT, k = {K}, {model.name}: full prefill vs document KV (turbo)"
    json_path, png_path = write_report("turbo", result, lambda path: plot(result, path, title))
    print(f"wrote {json_path} and {png_path}")
    load_ms = statistics.median(result["store_load_s"]) * 1000
    floor = result["kv_error"]["floor_max"]
    print(f"store load (read + rotate, a prompt): {load_ms:.1f} ms; KV error floor (p = 0): {floor:.4f}")
    accuracy = result["accuracy"]
    if accuracy["questions"]:
        print(
            f"accuracy on {accuracy['questions']} questions (k = {args.k}): "
            f"full {accuracy['full']:.3f} {_ci(accuracy['full_ci'])}, "
            f"turbo {accuracy['turbo']:.3f} {_ci(accuracy['turbo_ci'])}, "
            f"turbo − full {_ci(accuracy['delta_ci'])}; identical answers {accuracy['identical_answers']:.3f}"
        )
    summary = {
        "cold_full_ttft_ms": round(full_ms, 2),
        "turbo_ttft_ms": round(turbo_ms, 2),
        "ttft_turbo_over_full": round(turbo_ms / full_ms, 4),
        "store_load_ms": round(load_ms, 2),
        "kv_rel_err_max": round(result["kv_error"]["max"], 5),
        "single_doc_first_token_equal": result["single_document"]["equal"],
        "accuracy": {
            key: accuracy.get(key)
            for key in ("questions", "full", "turbo", "full_ci", "turbo_ci", "delta_ci")
        },
    }
    print_summary(summary)


if __name__ == "__main__":
    main()
