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
import contextlib
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    add_model_option,
    bootstrap_mean_ci,
    cpu_seconds,
    map_bounded,
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
from specrag.errors import InvalidInputError
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.config import KVEventSource
from specrag.pipeline.engines.protocol import Engine, Sampling
from specrag.pipeline.models.catalog import DEFAULT_MODEL_NAME
from specrag.pipeline.models.directory import served_model_name
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.index_store import BUILT_IN_EMBEDDERS, WORDLLAMA, IndexConfig, recorded_embedder
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assembly import ServiceOptions, open_controller, open_engine, prompt_builder
from specrag.service.run.assets import Assets, ensure_assets, ensure_index

METRICS = ("accuracy", "exact_match", "f1")
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
PATIENT: dict[str, Any] = {"first_token_timeout_s": 600.0, "inter_token_timeout_s": 600.0}
"""Liveness timeouts far beyond the service's: this bench judges answers, and on a busy shared
machine a batch of answers can wait seconds for a token; the service's stall detection would then
replace a working engine mid-run."""
EMBEDDER_CONFIGS = ("serial", "ordering_no_hint")
"""Configurations answered again on each compared embedder's index: plain RAG, and ``serve``'s default."""
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
    parser.add_argument("-k", type=int, default=4, help="passages per prompt (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=24, help="answer length cap (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="question sampling and bootstrap seed")
    parser.add_argument("--eager", action="store_true", help="no graph compilation (faster start)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="questions answered at once, but in speculation (default %(default)s; 1: one at a time)",
    )
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
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
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


Timings = dict[str, dict[str, float]]
"""Each phase's wall seconds and the CPU seconds of the engine and of this process during it."""


@contextlib.contextmanager
def timed(timings: Timings, name: str) -> Iterator[None]:
    """Record the block's wall and CPU seconds in ``timings[name]``."""
    service, engine = cpu_seconds()
    started = time.perf_counter()
    yield
    service_after, engine_after = cpu_seconds()
    timings[name] = {
        "wall_s": time.perf_counter() - started,
        "engine_cpu_s": engine_after - engine,
        "service_cpu_s": service_after - service,
    }


def controller_config(mode: ModeName, **overrides: Any) -> ControllerConfig:
    """A configuration's controller settings, with :data:`PATIENT` timeouts."""
    return replace(ControllerConfig(), mode=mode, **PATIENT, **overrides)


def _single_turn_record(
    assets: Assets, question: QualityQuestion, done: AnswerDone, tokens: tuple[int, ...]
) -> dict[str, Any]:
    return _record(
        question,
        done.text,
        tokens=list(tokens),
        documents=list(done.timeline.documents),
        gold_retrieved=question.passage_id in done.timeline.documents,
        gold_row=assets.store.row_of(question.passage_id),
        adopted=bool(done.timeline.adopted),
        prompt_rows=list(done.prompt.document_ids()),
        reordered=list(done.prompt.document_ids()) != _rows(assets, done),
    )


async def answer_configuration(
    engine: Engine,
    kv_events: KVEventSource | None,
    index: VectorIndex,
    assets: Assets,
    builder: PromptBuilder,
    questions: Sequence[QualityQuestion],
    args: argparse.Namespace,
    config: ControllerConfig,
    concurrency: int,
) -> list[dict[str, Any]]:
    """Every question answered through a fresh controller over ``index``, ``concurrency`` at once;
    one record a question, in the questions' order."""
    async with open_controller(engine, kv_events, index, builder, config) as (controller, _):

        async def one(question: QualityQuestion) -> dict[str, Any]:
            request = RagRequest(question.question, k=args.k, mode=config.mode, max_tokens=args.max_tokens)
            done, tokens = await _ask(controller, request)
            return _single_turn_record(assets, question, done, tokens)

        return await map_bounded(one, questions, concurrency)


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
        text, _ = await _generate(engine, builder.build([], question.question).token_ids, args.max_tokens)
        return _record(question, text)

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


def agreement(together: Sequence[dict[str, Any]], alone: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How many answers computed together equal those computed alone, token for token and in
    correctness."""
    pairs = list(zip(together, alone, strict=True))
    return {
        "questions": len(pairs),
        "identical_tokens": sum(a["tokens"] == b["tokens"] for a, b in pairs),
        "same_accuracy": sum(a["accuracy"] == b["accuracy"] for a, b in pairs),
    }


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
            opening, opening_tokens = await _ask(controller, request)
            request = replace(request, question=second.question)
            done, _ = await _ask(controller, request)
            controller.close_session(session, "quality")
            dedup = _record(second, done.text, prompt_tokens=len(done.prompt.token_ids))
            # The same conversation with nothing dropped: the first turn's prompt and answer, then
            # this turn's documents (every one of them) and question.
            history = (*opening.prompt.token_ids, *opening_tokens)
            layout = builder.build(_rows(assets, done), second.question, history=history)
            text, _ = await _generate(engine, layout.token_ids, args.max_tokens)
            return dedup, _record(second, text, prompt_tokens=len(layout.token_ids))

        pairs = await map_bounded(one, conversations, args.concurrency)
    return {"multiturn_dedup": [d for d, _ in pairs], "multiturn_full": [f for _, f in pairs]}


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


def _mean_ci(values: np.ndarray, rng: np.random.Generator) -> dict[str, Any]:
    return {"mean": float(values.mean()), "ci": bootstrap_mean_ci(values, rng)}


def compare_embedders(
    results: dict[str, list[dict[str, Any]]], main: str, others: Sequence[str], seed: int
) -> dict[str, dict[str, Any]]:
    """Does better retrieval raise accuracy? For each of :data:`EMBEDDER_CONFIGS` and each
    embedder, the share of questions whose answering passage was in the top k and the accuracy,
    and the paired differences ``main`` − other (the same questions, resampled together)."""
    rng = np.random.default_rng(seed)
    comparison: dict[str, dict[str, Any]] = {}
    for config in EMBEDDER_CONFIGS:
        rows = {main: results[config]} | {other: results[f"{config}@{other}"] for other in others}
        values = {
            name: {
                metric: np.array([r[metric] for r in mine], dtype=float)
                for metric in ("gold_retrieved", "accuracy")
            }
            for name, mine in rows.items()
        }
        entry: dict[str, Any] = {
            name: {metric: _mean_ci(array, rng) for metric, array in mine.items()}
            for name, mine in values.items()
        }
        for other in others:
            entry[f"{main}_minus_{other}"] = {
                metric: _mean_ci(values[main][metric] - values[other][metric], rng)
                for metric in ("gold_retrieved", "accuracy")
            }
        comparison[config] = entry
    return comparison


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


def _rounded(value: Any) -> Any:
    """``value`` (a figure, an interval or a mapping of them) to three decimals."""
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return round(value, 3) if isinstance(value, float) else value


def headline(
    facts: dict[str, Any],
    summary: dict[str, dict[str, Any]],
    embedders: dict[str, dict[str, Any]] | None = None,
    concurrent_vs_alone: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The last line: the issue's shape, every configuration's accuracy and F1, deltas with CIs,
    the embedders compared and how concurrent answers agreed with answers computed alone."""
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
        "embedders": _rounded(embedders or {}),
        "concurrent_vs_alone": concurrent_vs_alone,
    }


def _interval(interval: Sequence[float]) -> str:
    return f"[{interval[0]:.3f}, {interval[1]:.3f}]"


def main() -> None:
    args = parse_args()
    result = run_measurement(run(args))
    for name, entry in result["summary"].items():
        print(
            f"{name:26s} accuracy {entry['accuracy']:.3f} {_interval(entry['accuracy_ci'])} "
            f"f1 {entry['f1']:.3f}"
        )
    for config, entry in result["embedders"].items():
        for name, figures in entry.items():
            gold, accuracy = figures["gold_retrieved"], figures["accuracy"]
            print(
                f"{config} {name:24s} gold in top k {gold['mean']:+.3f} {_interval(gold['ci'])} "
                f"accuracy {accuracy['mean']:+.3f} {_interval(accuracy['ci'])}"
            )
    print_summary(
        headline(result["facts"], result["summary"], result["embedders"], result["concurrent_vs_alone"])
    )


if __name__ == "__main__":
    main()
