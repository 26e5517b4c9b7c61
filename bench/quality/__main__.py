"""Answer quality of every configuration on the real default model: do the fast paths keep answers right?

Each question of :mod:`bench.quality.questions` (the corpus holds every answer) is asked, with the
service's default decoding (greedy with its repetition control, bench.quality.decoding), in
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
- ``serial@NAME`` / ``ordering_no_hint@NAME``: serial and ``serve``'s default again on an index of
  the same corpus embedded by ``NAME`` (``--compare-embedders``, default WordLlama; its index is
  kept in ``index-NAME`` of ``--compare-dir`` and reused while valid). ``embedders`` in the JSON
  answers "does better retrieval raise accuracy?": per embedder the share of questions whose
  answering passage is in the top k and the accuracy, and the paired differences (the data
  directory's embedder − NAME) with intervals.

Only answers are compared, not times, so every configuration but ``speculation`` (whose launches
depend on the gate's room) asks ``--concurrency`` questions at once and vLLM batches their decoding.
``concurrent_vs_alone`` asks ``serial``'s first ``--agreement-sample`` questions again one at a time
and counts the answers equal token for token. Each phase's wall time and the CPU seconds of the
engine during it are in ``facts.timings`` (on a shared machine the engine's CPU seconds are the
better guide to a quiet one's wall time).

Accuracy is "the answer contains the gold name" (a chat model answers in a sentence), exact match
is "the answer is the name", F1 is word-level (:func:`bench.quality.questions.score`); each with a 95 %
bootstrap interval over questions, and for each configuration the paired difference to serial
(the same questions, resampled together). ``by_gold_position`` splits accuracy by where the
passage that answers sits in the prompt (1 = first; 0 = not retrieved). Writes
bench/out/quality.json and quality.png; the last line printed is a JSON summary.
Rerun: ``python -m bench.quality [--quick]`` (``--quick``: fewer questions, see docs/quality.md).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import add_model_option, map_bounded, print_summary, run_measurement, write_json
from bench.quality.answering import (
    Timings,
    add_answer_options,
    answer_configuration,
    ask,
    controller_config,
    final_rows,
    generate,
    record,
    timed,
)
from bench.quality.questions import (
    QUESTION_COUNT,
    Conversation,
    QualityQuestion,
    build_conversations,
    build_questions,
)
from bench.quality.summary import (
    EMBEDDER_CONFIGS,
    agreement,
    compare_embedders,
    headline,
    interval,
    plot,
    summarize,
)
from specrag.controller.controller import RagRequest
from specrag.controller.modes import ModeName
from specrag.errors import InvalidInputError
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.config import KVEventSource
from specrag.pipeline.engines.protocol import Engine
from specrag.pipeline.models.catalog import DEFAULT_MODEL_NAME
from specrag.pipeline.models.directory import served_model_name
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.index_store import BUILT_IN_EMBEDDERS, WORDLLAMA, IndexConfig, recorded_embedder
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assembly import ServiceOptions, open_controller, open_engine, prompt_builder
from specrag.service.run.assets import Assets, ensure_assets, ensure_index

# (name, mode, controller overrides): the single-turn configurations run through the controller.
CONTROLLER_CONFIGS: tuple[tuple[str, ModeName, dict[str, Any]], ...] = (
    ("serial", ModeName.SERIAL, {}),
    ("ordering", ModeName.ORDERING, {"order_hint": True}),
    ("ordering_no_hint", ModeName.ORDERING, {"order_hint": False}),
    ("speculation", ModeName.SPECULATION, {"speculation": "always"}),
)
SEQUENTIAL = frozenset({"speculation"})
"""Configurations answered one question at a time: whether a speculation launches depends on the
gate's room, which answers running beside it would take."""
QUICK_QUESTIONS = 40
"""``--quick``'s questions: sized to end within 15 minutes on a 2-core machine without native
bfloat16 (docs/quality.md gives the sum); on the default corpus they are the full set's first 40."""
QUICK_CONVERSATIONS = 12


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_QUESTIONS} questions and {QUICK_CONVERSATIONS} conversations",
    )
    add_model_option(parser, DEFAULT_MODEL_NAME, "answer quality needs a real model")
    parser.add_argument(
        "--questions",
        type=int,
        help=f"single-turn questions (default {QUESTION_COUNT}, quick {QUICK_QUESTIONS})",
    )
    parser.add_argument(
        "--conversations", type=int, help=f"two-turn conversations (default 60, quick {QUICK_CONVERSATIONS})"
    )
    add_answer_options(parser, max_tokens=24, why="(default %(default)s)")
    parser.add_argument(
        "--compare-embedders",
        default=WORDLLAMA,
        help=f"built-in embedders ({', '.join(BUILT_IN_EMBEDDERS)}, comma-separated; '' for none) whose "
        f"indexes answer {' and '.join(EMBEDDER_CONFIGS)} too (default %(default)s)",
    )
    parser.add_argument(
        "--compare-dir",
        type=Path,
        help="where their indexes are kept, each in index-NAME, built if missing or stale "
        "(default: the data directory)",
    )
    parser.add_argument(
        "--agreement-sample",
        type=int,
        default=16,
        help="serial questions asked again one at a time, to compare with the concurrent answers",
    )
    args = parser.parse_args()
    args.questions = args.questions or (QUICK_QUESTIONS if args.quick else QUESTION_COUNT)
    args.conversations = args.conversations or (QUICK_CONVERSATIONS if args.quick else 60)
    args.compare_embedders = [name for name in args.compare_embedders.split(",") if name]
    for name in args.compare_embedders:
        if name not in BUILT_IN_EMBEDDERS:
            parser.error(f"unknown embedder {name!r}; choose among {', '.join(BUILT_IN_EMBEDDERS)}")
    return args


def compared_indexes(
    layout: DataLayout, assets: Assets, names: Sequence[str], directory: Path | None
) -> dict[str, VectorIndex]:
    """An index of the same corpus, built like the default one but for its embedder, for each of
    ``names``; each kept in ``directory/index-NAME`` (reused when present and valid)."""
    recorded = recorded_embedder(layout.index_dir)
    indexes = {}
    for name in names:
        config = IndexConfig(embedder=name)
        if config.embedder_mismatch(recorded) is None:
            raise InvalidInputError(f"the data directory's index is already embedded by {name}")
        where = (directory or layout.root) / f"index-{name}"
        print(f"{name} index in {where}: built if missing or stale", flush=True)
        indexes[name] = ensure_index(layout, assets.passages, config, where)
    return indexes


async def run_single_turn(
    engine: Engine,
    kv_events: KVEventSource | None,
    assets: Assets,
    builder: PromptBuilder,
    questions: Sequence[QualityQuestion],
    args: argparse.Namespace,
    compared: Mapping[str, VectorIndex] | None = None,
    timings: Timings | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Every single-turn configuration on the data directory's index, then :data:`EMBEDDER_CONFIGS`
    again on each ``compared`` embedder's index (named ``CONFIG@EMBEDDER``); each one's time in
    ``timings``."""
    timings = {} if timings is None else timings

    async def no_documents(question: QualityQuestion) -> dict[str, Any]:
        text, _ = await generate(engine, builder.build([], question.question).token_ids, args.max_tokens)
        return record(question, text)

    with timed(timings, "no_documents"):
        results = {"no_documents": await map_bounded(no_documents, questions, args.concurrency)}
    runs = [(name, assets.index, mode, overrides) for name, mode, overrides in CONTROLLER_CONFIGS]
    for embedder, index in (compared or {}).items():
        runs += [
            (f"{name}@{embedder}", index, mode, overrides)
            for name, mode, overrides in CONTROLLER_CONFIGS
            if name in EMBEDDER_CONFIGS
        ]
    for name, index, mode, overrides in runs:
        concurrency = 1 if name in SEQUENTIAL else args.concurrency
        config = controller_config(mode, **overrides)
        with timed(timings, name):
            rows = await answer_configuration(
                engine, kv_events, index, assets, builder, questions, args, config, concurrency
            )
        results[name] = rows
        print(
            f"{name}: accuracy {np.mean([r['accuracy'] for r in rows]):.3f} ({concurrency} at once: "
            f"{timings[name]['wall_s']:.0f} s, engine CPU {timings[name]['engine_cpu_s']:.0f} s)",
            flush=True,
        )
    return results


async def check_concurrency(
    engine: Engine,
    kv_events: KVEventSource | None,
    assets: Assets,
    builder: PromptBuilder,
    concurrent: Sequence[dict[str, Any]],
    questions: Sequence[QualityQuestion],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """``serial``'s first ``--agreement-sample`` questions asked again one at a time: do answers
    computed in a batch equal those computed alone? (Greedy decoding is deterministic for one
    computation; a batch sums in another order, which can flip a near-tied token.)"""
    sample = questions[: args.agreement_sample]
    config = controller_config(ModeName.SERIAL)
    alone = await answer_configuration(
        engine, kv_events, assets.index, assets, builder, sample, args, config, 1
    )
    return agreement(concurrent[: len(sample)], alone)


async def run_conversations(
    engine: Engine,
    kv_events: KVEventSource | None,
    assets: Assets,
    builder: PromptBuilder,
    conversations: Sequence[Conversation],
    args: argparse.Namespace,
) -> dict[str, list[dict[str, Any]]]:
    """Second turns with de-duplication (sessions) and with the full history re-sent."""
    config = controller_config(ModeName.SERIAL)
    async with open_controller(engine, kv_events, assets.index, builder, config) as (controller, _):

        async def one(conversation: Conversation) -> tuple[dict[str, Any], dict[str, Any]]:
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
            opening, opening_tokens = await ask(controller, request)
            request = replace(request, question=second.question)
            done, _ = await ask(controller, request)
            controller.close_session(session, "quality")
            dedup = record(second, done.text, prompt_tokens=len(done.prompt.token_ids))
            # The same conversation with nothing dropped: the first turn's prompt and answer, then
            # this turn's documents (every one of them) and question.
            history = (*opening.prompt.token_ids, *opening_tokens)
            layout = builder.build(final_rows(assets, done), second.question, history=history)
            text, _ = await generate(engine, layout.token_ids, args.max_tokens)
            return dedup, record(second, text, prompt_tokens=len(layout.token_ids))

        pairs = await map_bounded(one, conversations, args.concurrency)
    return {"multiturn_dedup": [d for d, _ in pairs], "multiturn_full": [f for _, f in pairs]}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    layout = DataLayout(resolve_data_dir())
    assets = ensure_assets(layout, args.model)
    compared = compared_indexes(layout, assets, args.compare_embedders, args.compare_dir)
    main_embedder = assets.index.embedder.kind if assets.index.embedder is not None else "index"
    questions = build_questions(assets.passages, args.questions, args.seed)
    conversations = build_conversations(assets.passages, args.conversations, args.seed, exclude=questions)
    model = served_model_name(assets.model_dir)
    print(f"{model}: {len(questions)} questions, {len(conversations)} conversations, k={args.k}", flush=True)
    started = time.perf_counter()
    options = ServiceOptions(eager=args.eager)
    async with open_engine(assets.model_dir, options, layout.root / "run" / "quality") as (engine, kv_events):
        engine_ready = time.perf_counter()
        builder = prompt_builder(assets, engine)
        timings: Timings = {}
        results = await run_single_turn(
            engine, kv_events, assets, builder, questions, args, compared, timings
        )
        with timed(timings, "conversations"):
            results |= await run_conversations(engine, kv_events, assets, builder, conversations, args)
        concurrency = None
        if args.concurrency > 1 and args.agreement_sample > 0:
            with timed(timings, "agreement_check"):
                concurrency = await check_concurrency(
                    engine, kv_events, assets, builder, results["serial"], questions, args
                )
    summary = summarize(results, args.seed)
    embedders = compare_embedders(results, main_embedder, list(compared), args.seed)
    facts = {
        "model": model,
        "questions": len(questions),
        "conversations": len(conversations),
        "k": args.k,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "concurrency": args.concurrency,
        "embedder": main_embedder,
        "compared_embedders": list(compared),
        "prepare_s": started - began,
        "engine_start_s": engine_ready - started,
        "wall_s": time.perf_counter() - started,
        "timings": timings,
    }
    records = {
        "facts": facts,
        "summary": summary,
        "embedders": embedders,
        "concurrent_vs_alone": concurrency,
        "records": results,
        "questions": [asdict(q) for q in questions],
    }
    write_json("quality", records)
    plot(summary, f"Answer quality, {model}, {len(questions)} questions, k={args.k}")
    return {"facts": facts, "summary": summary, "embedders": embedders, "concurrent_vs_alone": concurrency}


def main() -> None:
    args = parse_args()
    result = run_measurement(run(args))
    for name, entry in result["summary"].items():
        print(
            f"{name:26s} accuracy {entry['accuracy']:.3f} {interval(entry['accuracy_ci'])} "
            f"f1 {entry['f1']:.3f}"
        )
    for config, entry in result["embedders"].items():
        for name, figures in entry.items():
            gold, accuracy = figures["gold_retrieved"], figures["accuracy"]
            print(
                f"{config} {name:24s} gold in top k {gold['mean']:+.3f} {interval(gold['ci'])} "
                f"accuracy {accuracy['mean']:+.3f} {interval(accuracy['ci'])}"
            )
    print_summary(
        headline(result["facts"], result["summary"], result["embedders"], result["concurrent_vs_alone"])
    )


if __name__ == "__main__":
    main()
