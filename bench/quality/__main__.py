"""Answer quality of every configuration on the real default model: do the fast paths keep answers right?

Each question of :mod:`bench.quality.questions` (the corpus holds every answer) is asked, greedily, in
every configuration, on one in-process vLLM engine and one index:

- ``no_documents``: the question alone, after the system prompt: what the model knows by itself;
- ``serial``: plain RAG, documents in retrieval order (the baseline);
- ``ordering``: exact ordering for prefix reuse, with the order hint restating the ranking;
- ``ordering_no_hint``: the same order without the hint;
- ``speculation``: staged search with speculative prefill, launched at every stage
  (``speculation="always"``: the priced default rarely speculates on the small default index,
  where search is short, and this check needs speculations to adopt). Its final prompt is
  serial's (no reordering), so its answer must be serial's token for token whenever it adopted a
  speculation: ``identical_to_serial`` is the share of adopted answers whose tokens equal serial's;
- ``multiturn_dedup`` / ``multiturn_full``: two-question conversations about one module, the second
  turn either as sessions do it (documents the conversation already holds are not sent again; a
  location hint points to them) or with the whole history and every document sent again. Their
  scores are the second turns'.

Accuracy is "the answer contains the gold name" (a chat model answers in a sentence), exact match
is "the answer is the name", F1 is word-level (:func:`bench.quality.questions.score`); each with a 95 %
bootstrap interval over questions, and for each configuration the paired difference to serial
(the same questions, resampled together). ``by_gold_position`` splits accuracy by where the
passage that answers sits in the prompt (1 = first; 0 = not retrieved). Writes
bench/out/quality.json and quality.png; the last line printed is a JSON summary.
Rerun: ``python -m bench.quality [--quick]``.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from bench.common import (
    add_model_option,
    bootstrap_mean_ci,
    plot_path,
    print_summary,
    run_measurement,
    save_figure,
    write_json,
)
from bench.quality.questions import (
    QUESTION_COUNT,
    Conversation,
    QualityQuestion,
    build_conversations,
    build_questions,
    score,
)
from specrag.controller.controller import ControllerConfig, RagController, RagRequest
from specrag.controller.modes import ModeName
from specrag.controller.query import AnswerDelta, AnswerDone
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.config import KVEventSource
from specrag.pipeline.engines.protocol import Engine, Sampling
from specrag.pipeline.models.catalog import DEFAULT_MODEL_NAME
from specrag.pipeline.models.directory import served_model_name
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.service.run.assembly import ServiceOptions, open_controller, open_engine, prompt_builder
from specrag.service.run.assets import Assets, ensure_assets

METRICS = ("accuracy", "exact_match", "f1")
# (name, mode, controller overrides): the single-turn configurations run through the controller.
CONTROLLER_CONFIGS: tuple[tuple[str, ModeName, dict[str, Any]], ...] = (
    ("serial", ModeName.SERIAL, {}),
    ("ordering", ModeName.ORDERING, {"order_hint": True}),
    ("ordering_no_hint", ModeName.ORDERING, {"order_hint": False}),
    ("speculation", ModeName.SPECULATION, {"speculation": "always"}),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUESTION_COUNT} questions and 24 conversations"
    )
    add_model_option(parser, DEFAULT_MODEL_NAME, "answer quality needs a real model")
    parser.add_argument("--questions", type=int, help=f"single-turn questions (default {QUESTION_COUNT})")
    parser.add_argument("--conversations", type=int, help="two-turn conversations (default 60, quick 24)")
    parser.add_argument("-k", type=int, default=4, help="passages per prompt (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=24, help="answer length cap (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="question sampling and bootstrap seed")
    parser.add_argument("--eager", action="store_true", help="no graph compilation (faster start)")
    args = parser.parse_args()
    args.questions = args.questions or QUESTION_COUNT
    args.conversations = args.conversations or (24 if args.quick else 60)
    return args


async def _ask(controller: RagController, request: RagRequest) -> tuple[AnswerDone, tuple[int, ...]]:
    """The answer and its generated token ids (the token-identity check needs the tokens)."""
    tokens: list[int] = []
    done: AnswerDone | None = None
    async for event in controller.stream(request):  # to its end: a session's turn ends there
        if isinstance(event, AnswerDelta):
            tokens.extend(event.token_ids)
        else:
            done = event
    if done is None:
        raise RuntimeError("the answer stream ended without its done event")
    return done, tuple(tokens)


async def _generate(engine: Engine, prompt: Sequence[int], max_tokens: int) -> tuple[str, tuple[int, ...]]:
    texts: list[str] = []
    tokens: list[int] = []
    request_id = "quality-" + uuid.uuid4().hex
    async for output in engine.generate(request_id, prompt, Sampling(max_tokens=max_tokens)):
        texts.append(output.text)
        tokens.extend(output.token_ids)
    return "".join(texts), tuple(tokens)


def _rows(assets: Assets, done: AnswerDone) -> list[int]:
    """The final top-k as store rows, in retrieval rank order."""
    return [assets.store.row_of(passage_id) for passage_id in done.timeline.documents]


def _record(question: QualityQuestion, answer: str, **extra: Any) -> dict[str, Any]:
    scores = score(answer, question.answer)
    return {"question": question.question, "gold": question.answer, "answer": answer, **scores, **extra}


async def run_single_turn(
    engine: Engine,
    kv_events: KVEventSource | None,
    assets: Assets,
    builder: PromptBuilder,
    questions: Sequence[QualityQuestion],
    args: argparse.Namespace,
) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {"no_documents": []}
    for question in questions:
        text, _ = await _generate(engine, builder.build([], question.question).token_ids, args.max_tokens)
        results["no_documents"].append(_record(question, text))
    for name, mode, overrides in CONTROLLER_CONFIGS:
        config = replace(ControllerConfig(), mode=mode, **overrides)
        async with open_controller(engine, kv_events, assets.index, builder, config) as (controller, _):
            rows = []
            for question in questions:
                request = RagRequest(question.question, k=args.k, mode=mode, max_tokens=args.max_tokens)
                done, tokens = await _ask(controller, request)
                gold_row = assets.store.row_of(question.passage_id)
                rows.append(
                    _record(
                        question,
                        done.text,
                        tokens=list(tokens),
                        documents=list(done.timeline.documents),
                        gold_retrieved=question.passage_id in done.timeline.documents,
                        gold_row=gold_row,
                        adopted=bool(done.timeline.adopted),
                        prompt_rows=list(done.prompt.document_ids()),
                        reordered=list(done.prompt.document_ids()) != _rows(assets, done),
                    )
                )
        results[name] = rows
        print(f"{name}: accuracy {np.mean([r['accuracy'] for r in rows]):.3f}", flush=True)
    return results


async def run_conversations(
    engine: Engine,
    kv_events: KVEventSource | None,
    assets: Assets,
    builder: PromptBuilder,
    conversations: Sequence[Conversation],
    args: argparse.Namespace,
) -> dict[str, list[dict[str, Any]]]:
    """Second turns with de-duplication (sessions) and with the full history re-sent."""
    dedup, full = [], []
    config = replace(ControllerConfig(), mode=ModeName.SERIAL)
    async with open_controller(engine, kv_events, assets.index, builder, config) as (controller, _):
        for conversation in conversations:
            first, second = conversation.turns
            session = controller.create_session("quality")
            request = RagRequest(
                first.question,
                k=args.k,
                mode="serial",
                max_tokens=args.max_tokens,
                session_id=session,
                client="quality",
            )
            opening, opening_tokens = await _ask(controller, request)
            request = replace(request, question=second.question)
            done, _ = await _ask(controller, request)
            controller.close_session(session, "quality")
            dedup.append(_record(second, done.text, prompt_tokens=len(done.prompt.token_ids)))
            # The same conversation with nothing dropped: the first turn's prompt and answer, then
            # this turn's documents (every one of them) and question.
            rows = _rows(assets, done)
            history = (*opening.prompt.token_ids, *opening_tokens)
            layout = builder.build(rows, second.question, history=history)
            text, _ = await _generate(engine, layout.token_ids, args.max_tokens)
            full.append(_record(second, text, prompt_tokens=len(layout.token_ids)))
    return {"multiturn_dedup": dedup, "multiturn_full": full}


BASELINES = {"multiturn_dedup": ("multiturn_full", "full_history"), "multiturn_full": None, "serial": None}
"""What each configuration is compared with, paired question by question (default: serial)."""


def by_gold_position(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Accuracy by the answering passage's place in the prompt (1 = first, 0 = not retrieved)."""
    groups: dict[int, list[float]] = {}
    for row in rows:
        order = row["prompt_rows"]
        position = order.index(row["gold_row"]) + 1 if row["gold_row"] in order else 0
        groups.setdefault(position, []).append(row["accuracy"])
    return {
        str(position): {"questions": len(values), "accuracy": float(np.mean(values))}
        for position, values in sorted(groups.items())
    }


def summarize(results: dict[str, list[dict[str, Any]]], seed: int) -> dict[str, dict[str, Any]]:
    """Each configuration's metrics with intervals, and its paired difference to its baseline."""
    rng = np.random.default_rng(seed)
    summary: dict[str, dict[str, Any]] = {}
    for name, rows in results.items():
        entry: dict[str, Any] = {"questions": len(rows)}
        for metric in METRICS:
            values = np.array([r[metric] for r in rows])
            entry[metric] = float(values.mean())
            entry[f"{metric}_ci"] = bootstrap_mean_ci(values, rng)
        baseline, label = BASELINES.get(name, ("serial", "serial")) or (None, None)
        if baseline is not None:
            for metric in ("accuracy", "f1"):
                delta = np.array([r[metric] for r in rows]) - np.array([r[metric] for r in results[baseline]])
                entry[f"{metric}_delta_vs_{label}"] = float(delta.mean())
                entry[f"{metric}_delta_vs_{label}_ci"] = bootstrap_mean_ci(delta, rng)
            entry[f"delta_vs_{label}_ci"] = entry[f"accuracy_delta_vs_{label}_ci"]
        if rows and "gold_retrieved" in rows[0]:
            entry["gold_retrieved"] = float(np.mean([r["gold_retrieved"] for r in rows]))
            entry["reordered"] = float(np.mean([r["reordered"] for r in rows]))
            entry["by_gold_position"] = by_gold_position(rows)
        summary[name] = entry
    speculation, serial = results["speculation"], results["serial"]
    pairs = list(zip(speculation, serial, strict=True))
    adopted = [(s, b) for s, b in pairs if s["adopted"]]
    summary["speculation"]["adopted"] = len(adopted) / len(pairs)
    summary["speculation"]["identical_to_serial"] = (
        float(np.mean([s["tokens"] == b["tokens"] for s, b in adopted])) if adopted else None
    )
    summary["speculation"]["identical_to_serial_all"] = float(
        np.mean([s["tokens"] == b["tokens"] for s, b in pairs])
    )
    return summary


def plot(summary: dict[str, dict[str, Any]], title: str) -> None:
    import matplotlib.pyplot as plt

    names = list(summary)
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for offset, metric in ((-0.2, "accuracy"), (0.2, "f1")):
        means = [summary[n][metric] for n in names]
        intervals = [summary[n][f"{metric}_ci"] for n in names]
        errors = np.array([[m - low, high - m] for m, (low, high) in zip(means, intervals, strict=True)]).T
        axis.bar(np.arange(len(names)) + offset, means, width=0.4, yerr=errors, capsize=3, label=metric)
    axis.set_xticks(np.arange(len(names)), names, rotation=25, ha="right")
    axis.set_ylim(0, 1)
    axis.set_ylabel("fraction (95 % bootstrap interval)")
    axis.set_title(title)
    axis.legend()
    axis.grid(axis="y", alpha=0.3)
    save_figure(figure, plot_path("quality"))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = DataLayout(resolve_data_dir())
    assets = ensure_assets(layout, args.model)
    questions = build_questions(assets.passages, args.questions, args.seed)
    conversations = build_conversations(assets.passages, args.conversations, args.seed, exclude=questions)
    model = served_model_name(assets.model_dir)
    print(f"{model}: {len(questions)} questions, {len(conversations)} conversations, k={args.k}", flush=True)
    started = time.perf_counter()
    options = ServiceOptions(eager=args.eager)
    async with open_engine(assets.model_dir, options, layout.root / "run" / "quality") as (engine, kv_events):
        builder = prompt_builder(assets, engine)
        results = await run_single_turn(engine, kv_events, assets, builder, questions, args)
        results |= await run_conversations(engine, kv_events, assets, builder, conversations, args)
    summary = summarize(results, args.seed)
    facts = {
        "model": model,
        "questions": len(questions),
        "conversations": len(conversations),
        "k": args.k,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "wall_s": time.perf_counter() - started,
    }
    records = {
        "facts": facts,
        "summary": summary,
        "records": results,
        "questions": [asdict(q) for q in questions],
    }
    write_json("quality", records)
    plot(summary, f"Answer quality, {model}, {len(questions)} questions, k={args.k}")
    return {"facts": facts, "summary": summary}


def headline(facts: dict[str, Any], summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The last line: the issue's shape, every configuration's accuracy and F1, deltas with CIs."""
    configs: dict[str, dict[str, Any]] = {}
    for name, entry in summary.items():
        row: dict[str, Any] = {metric: round(entry[metric], 3) for metric in METRICS}
        for key in ("delta_vs_serial_ci", "delta_vs_full_history_ci"):
            if key in entry:
                row[key] = [round(v, 3) for v in entry[key]]
        if name == "speculation":
            row["adopted"] = round(entry["adopted"], 3)
            identical = entry["identical_to_serial"]
            row["identical_to_serial"] = None if identical is None else round(identical, 3)
        configs[name] = row
    return {
        "model": facts["model"],
        "questions": facts["questions"],
        "conversations": facts["conversations"],
        "configs": configs,
    }


def main() -> None:
    args = parse_args()
    result = run_measurement(run(args))
    for name, entry in result["summary"].items():
        low, high = entry["accuracy_ci"]
        print(f"{name:18s} accuracy {entry['accuracy']:.3f} [{low:.3f}, {high:.3f}] f1 {entry['f1']:.3f}")
    print_summary(headline(result["facts"], result["summary"]))


if __name__ == "__main__":
    main()
