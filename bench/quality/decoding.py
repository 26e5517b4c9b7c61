"""Which decoding should the default model answer with? Accuracy and looping answers per setting.

A 135M model decoding greedily tends to loop: it repeats a run of words until ``max_tokens``
stops it. Each decoding setting of :data:`SETTINGS` (greedy; the model's own
``generation_config.json`` when it recommends any sampling; a few repetition controls) answers,
through the controller in ``serial`` mode (the same prompts for every setting, so differences are
paired question by question), with the service's default answer length:

- the module questions of :mod:`bench.quality.questions`: accuracy with its 95 % bootstrap interval,
  its paired difference to greedy, and the share of answers that loop;
- open questions about the same names ("What does ``FTP.sendeprt`` in ``ftplib`` do?"), the kind
  the demo asks: the share of answers that loop (no gold answer to score).

An answer **loops** when a run of :data:`LOOP_WORDS` words occurs in it twice (:func:`loops`). The
chosen setting (:func:`choose`) keeps greedy's accuracy (not below its interval) and loops least; it
meets the bar when at most :data:`MAX_LOOP_SHARE` of its answers loop in either set.

Then, for greedy and the chosen setting, on the first ``--identity-sample`` module questions each
asked alone: ``speculation`` (a speculative prefill at every stage) against ``serial``, and ``all``
(ordering and speculation) against ``ordering`` without speculation: of the answers whose final
prompts are the same documents in the same order, the share equal token for token. Penalties are a
function of the prompt and the tokens so far, so like greedy they keep an adopted speculation's
answer the serial one.

Writes bench/out/quality_decoding.json and quality_decoding.png; the last line is a JSON summary.
Rerun: ``python -m bench.quality.decoding [--questions N]`` (docs/quality.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    OUT_DIR,
    add_model_option,
    bootstrap_mean_ci,
    print_summary,
    run_measurement,
    write_json,
)
from bench.quality.answering import (
    Timings,
    add_answer_options,
    answer_configuration,
    controller_config,
    timed,
)
from bench.quality.questions import QualityQuestion, build_questions
from bench.quality.summary import bar_chart
from specrag.controller.config import ControllerConfig
from specrag.controller.modes import ModeName
from specrag.controller.sampling import NEUTRAL_PENALTIES
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.config import KVEventSource
from specrag.pipeline.engines.protocol import Engine
from specrag.pipeline.models.catalog import DEFAULT_MODEL_NAME
from specrag.pipeline.models.directory import served_model_name
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.service.run.assembly import ServiceOptions, open_engine, prompt_builder
from specrag.service.run.assets import Assets, ensure_assets

__all__ = [
    "LOOP_WORDS",
    "MAX_LOOP_SHARE",
    "SETTINGS",
    "Answer",
    "Setting",
    "answerer",
    "check_identity",
    "choose",
    "loops",
    "model_setting",
]

LOOP_WORDS = 6
"""A run of this many words said twice is a loop (the issue's measure: 10 of 15 demo-like answers)."""
MAX_LOOP_SHARE = 0.05
"""The most answers of either set a chosen setting may loop in."""
OPEN_TEMPLATE = "What does `{name}` in the `{module}` module do?"


@dataclass(frozen=True)
class Setting:
    """A decoding setting: the request fields it sets (every penalty, so that none takes the
    controller's default)."""

    name: str
    fields: Mapping[str, float] = field(default_factory=dict)

    def request_fields(self) -> dict[str, float]:
        return {**NEUTRAL_PENALTIES, **self.fields}


SETTINGS = (
    Setting("greedy"),
    Setting("repetition_penalty=1.1", {"repetition_penalty": 1.1}),
    Setting("repetition_penalty=1.2", {"repetition_penalty": 1.2}),
    Setting("frequency_penalty=0.3", {"frequency_penalty": 0.3}),
    Setting("frequency_penalty=0.5", {"frequency_penalty": 0.5}),
    Setting("frequency_penalty=1.0", {"frequency_penalty": 1.0}),
    Setting("frequency_penalty=1.5", {"frequency_penalty": 1.5}),
    Setting("frequency_penalty=2.0", {"frequency_penalty": 2.0}),
    Setting("presence_penalty=0.5", {"presence_penalty": 0.5}),
    Setting("presence_penalty=1.0", {"presence_penalty": 1.0}),
)
"""Greedy and the repetition controls tried (``--settings`` picks some; greedy is always asked)."""
# What a model's generation_config.json may recommend that a request can ask for.
_GENERATION_KEYS = ("temperature", "top_p", "repetition_penalty")


def model_setting(model_dir: Path) -> Setting | None:
    """The sampling the model's ``generation_config.json`` recommends, as a setting; None when it
    has none (or recommends no sampling: greedy, which :data:`SETTINGS` has)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    recommended = {key: float(config[key]) for key in _GENERATION_KEYS if key in config}
    if not config.get("do_sample", False):
        recommended.pop("temperature", None)
        recommended.pop("top_p", None)
    return Setting("generation_config", recommended) if recommended else None


def _words(text: str) -> list[str]:
    return [word for word in (raw.strip(".,;:!?\"'`()[]") for raw in text.lower().split()) if word]


def loops(text: str, run: int = LOOP_WORDS) -> bool:
    """Whether some run of ``run`` consecutive words occurs twice in ``text`` (overlapping counts:
    one word said ``run`` + 1 times loops). Case and surrounding punctuation are ignored."""
    words = _words(text)
    seen: set[tuple[str, ...]] = set()
    for start in range(len(words) - run + 1):
        window = tuple(words[start : start + run])
        if window in seen:
            return True
        seen.add(window)
    return False


def open_questions(questions: Sequence[QualityQuestion]) -> list[QualityQuestion]:
    """The same names asked openly, as the demo asks (its gold stays the module, unscored)."""
    return [
        replace(q, question=OPEN_TEMPLATE.format(name=q.qualified_name[len(q.answer) + 1 :], module=q.answer))
        for q in questions
    ]


def _share(rows: Sequence[dict[str, Any]], rng: np.random.Generator, key: str) -> dict[str, Any]:
    values = np.array([float(row[key]) for row in rows])
    return {"mean": float(values.mean()), "ci": bootstrap_mean_ci(values, rng)}


def summarize(
    module: Mapping[str, list[dict[str, Any]]], opened: Mapping[str, list[dict[str, Any]]], seed: int
) -> dict[str, dict[str, Any]]:
    """Per setting: accuracy, its paired difference to greedy, and both sets' loop shares, each
    with its interval."""
    rng = np.random.default_rng(seed)
    greedy = np.array([row["accuracy"] for row in module["greedy"]], dtype=float)
    summary = {}
    for name, rows in module.items():
        accuracy = np.array([row["accuracy"] for row in rows], dtype=float)
        summary[name] = {
            "accuracy": _share(rows, rng, "accuracy"),
            "accuracy_minus_greedy": {
                "mean": float((accuracy - greedy).mean()),
                "ci": bootstrap_mean_ci(accuracy - greedy, rng),
            },
            "loops": _share(rows, rng, "loops"),
            "open_loops": _share(opened[name], rng, "loops") if opened.get(name) else None,
            "answer_words": float(np.mean([len(_words(row["answer"])) for row in rows])),
        }
    return summary


def _worst_loops(entry: Mapping[str, Any]) -> float:
    return max(entry["loops"]["mean"], (entry["open_loops"] or {"mean": 0.0})["mean"])


def choose(summary: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The setting that keeps greedy's accuracy (not below its interval: one above it keeps it too)
    and loops least (in the worse of the two sets; ties to the more accurate), and whether it meets
    :data:`MAX_LOOP_SHARE`."""
    low = summary["greedy"]["accuracy"]["ci"][0]
    keeping = [name for name, entry in summary.items() if entry["accuracy"]["mean"] >= low]
    chosen = min(keeping, key=lambda name: (_worst_loops(summary[name]), -summary[name]["accuracy"]["mean"]))
    worst = _worst_loops(summary[chosen])
    return {"setting": chosen, "worst_loop_share": worst, "meets_bar": worst <= MAX_LOOP_SHARE}


def _same_prompt_identical(
    answers: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    pairs = [(a, r) for a, r in zip(answers, reference, strict=True) if a["prompt_rows"] == r["prompt_rows"]]
    adopted = [(a, r) for a, r in pairs if a["adopted"]]
    return {
        "questions": len(answers),
        "same_prompt": len(pairs),
        "identical_tokens": sum(a["tokens"] == r["tokens"] for a, r in pairs),
        "adopted_same_prompt": len(adopted),
        "adopted_identical_tokens": sum(a["tokens"] == r["tokens"] for a, r in adopted),
    }


IDENTITY_RUNS: tuple[tuple[str, ModeName, dict[str, Any]], ...] = (
    ("serial", ModeName.SERIAL, {}),
    ("speculation", ModeName.SPECULATION, {"speculation": "always"}),
    ("ordering", ModeName.ORDERING, {}),
    ("all", ModeName.ALL, {"speculation": "always"}),
)
"""Each asked alone (no batch arithmetic), ``order_hint`` off as ``serve`` has it."""


Answer = Callable[
    [Sequence[QualityQuestion], ControllerConfig, int, Setting], Awaitable[list[dict[str, Any]]]
]
"""Questions answered through a fresh controller with this config, so many at once, decoded so."""


def answerer(
    engine: Engine,
    kv_events: KVEventSource | None,
    assets: Assets,
    builder: PromptBuilder,
    args: argparse.Namespace,
) -> Answer:
    """The :data:`Answer` of one engine and the data directory's index, asking as ``args`` say."""

    async def answer(
        asked: Sequence[QualityQuestion], config: ControllerConfig, concurrency: int, setting: Setting
    ) -> list[dict[str, Any]]:
        fields = setting.request_fields()
        return await answer_configuration(
            engine, kv_events, assets.index, assets, builder, asked, args, config, concurrency, fields
        )

    return answer


async def check_identity(
    answer: Answer, questions: Sequence[QualityQuestion], setting: Setting
) -> dict[str, Any]:
    """Speculation against serial, ``all`` against ordering, under ``setting``: answers of the same
    final prompt, equal token for token?"""
    rows = {}
    for name, mode, overrides in IDENTITY_RUNS:
        rows[name] = await answer(questions, controller_config(mode, **overrides), 1, setting)
    return {
        "speculation_vs_serial": _same_prompt_identical(rows["speculation"], rows["serial"]),
        "all_vs_ordering": _same_prompt_identical(rows["all"], rows["ordering"]),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.quality.decoding", description=__doc__.splitlines()[0]
    )
    add_model_option(parser, DEFAULT_MODEL_NAME, "loops and accuracy need a real model")
    parser.add_argument("--questions", type=int, default=300, help="module questions (default %(default)s)")
    parser.add_argument(
        "--open-questions", type=int, default=100, help="open questions, loops only (default %(default)s)"
    )
    parser.add_argument(
        "--settings",
        help="comma-separated names of SETTINGS to try besides greedy (default: all of them)",
    )
    parser.add_argument(
        "--identity-sample",
        type=int,
        default=40,
        help="module questions asked alone in each identity check (default %(default)s; 0: none)",
    )
    add_answer_options(
        parser,
        ControllerConfig().max_tokens_default,
        "(the service's default, %(default)s: where loops show)",
    )
    args = parser.parse_args()
    known = {setting.name: setting for setting in SETTINGS}
    names = args.settings.split(",") if args.settings else list(known)
    if unknown := [name for name in names if name not in known]:
        parser.error(f"unknown settings {', '.join(unknown)}; choose among {', '.join(known)}")
    args.settings = [known[name] for name in dict.fromkeys(["greedy", *names])]
    if args.questions < 1 or args.open_questions < 0 or args.identity_sample < 0:
        parser.error("--questions must be at least 1, --open-questions and --identity-sample at least 0")
    return args


Rows = dict[str, list[dict[str, Any]]]
"""Each setting's records, one a question, in the questions' order."""


async def answer_settings(
    answer: Answer,
    settings: Sequence[Setting],
    questions: Sequence[QualityQuestion],
    opened: Sequence[QualityQuestion],
    concurrency: int,
    checkpoint: Path | None = None,
) -> tuple[Rows, Rows]:
    """Every setting's answers to the module and the open questions (each record with ``loops``),
    in ``serial`` mode. The questions go in chunks, each answered under every setting before the
    next: the chunk's prompts are prefilled once and found in the prefix cache by every other
    setting (the whole set's prompts would not fit it). After each chunk the records so far go to
    ``checkpoint``, if given, so that a run stopped early leaves what it measured."""
    serial = controller_config(ModeName.SERIAL)
    # Open questions spread among the module ones, so that every chunk holds both kinds.
    kinds = sorted(
        [(i / len(questions), 0, i) for i in range(len(questions))]
        + [(i / len(opened), 1, i) for i in range(len(opened))]
    )
    asked = [(questions, opened)[kind][i] for _, kind, i in kinds]
    rows: Rows = {setting.name: [] for setting in settings}
    chunk = 2 * concurrency
    for start in range(0, len(asked), chunk):
        for setting in settings:
            rows[setting.name] += await answer(asked[start : start + chunk], serial, concurrency, setting)
        done = min(start + chunk, len(asked))
        if checkpoint is not None:
            record = json.dumps({"kinds": [kind for _, kind, _ in kinds[:done]], "rows": rows})
            await asyncio.to_thread(checkpoint.write_text, record)
        print(f"{done} of {len(asked)} questions answered", flush=True)
    split: tuple[Rows, Rows] = ({}, {})
    for name, mine in rows.items():
        for (_, kind, _), row in zip(kinds, mine, strict=True):
            split[kind].setdefault(name, []).append({**row, "loops": loops(row["answer"])})
    return split


async def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = DataLayout(resolve_data_dir())
    assets = ensure_assets(layout, args.model)
    questions = build_questions(assets.passages, args.questions, args.seed)
    opened = open_questions(questions[: args.open_questions])
    recommended = model_setting(assets.model_dir)
    settings = [*args.settings, *([recommended] if recommended is not None else [])]
    model = served_model_name(assets.model_dir)
    print(f"{model}: {len(questions)} + {len(opened)} open questions, {len(settings)} settings", flush=True)
    started = time.perf_counter()
    timings: Timings = {}
    async with open_engine(
        assets.model_dir, ServiceOptions(eager=args.eager), layout.root / "run" / "quality"
    ) as (
        engine,
        kv_events,
    ):
        answer = answerer(engine, kv_events, assets, prompt_builder(assets, engine), args)
        with timed(timings, "settings"):
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            module_rows, open_rows = await answer_settings(
                answer,
                settings,
                questions,
                opened,
                args.concurrency,
                OUT_DIR / "quality_decoding.partial.json",
            )
        summary = summarize(module_rows, open_rows, args.seed)
        chosen = choose(summary)
        identity = {}
        if args.identity_sample:
            by_name = {setting.name: setting for setting in settings}
            sample = questions[: args.identity_sample]
            for name in dict.fromkeys(("greedy", chosen["setting"])):
                with timed(timings, f"identity {name}"):
                    identity[name] = await check_identity(answer, sample, by_name[name])
                print(f"identity under {name}: {identity[name]}", flush=True)
    facts = {
        "model": model,
        "questions": len(questions),
        "open_questions": len(opened),
        "k": args.k,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "concurrency": args.concurrency,
        "eager": args.eager,
        "loop_words": LOOP_WORDS,
        "settings": {setting.name: setting.request_fields() for setting in settings},
        "generation_config": None if recommended is None else dict(recommended.fields),
        "wall_s": time.perf_counter() - started,
        "timings": timings,
    }
    write_json(
        "quality_decoding",
        {
            "facts": facts,
            "summary": summary,
            "chosen": chosen,
            "identity": identity,
            "records": {"module": module_rows, "open": open_rows},
            "questions": [asdict(q) for q in questions],
        },
    )
    plot(summary, f"Decoding settings, {model}, {len(questions)} questions, {args.max_tokens} tokens")
    return {"facts": facts, "summary": summary, "chosen": chosen, "identity": identity}


def plot(summary: Mapping[str, Mapping[str, Any]], title: str) -> None:
    names = list(summary)
    series = []
    for key, label in (
        ("accuracy", "accuracy"),
        ("loops", "loops (module questions)"),
        ("open_loops", "loops (open)"),
    ):
        entries = [summary[name][key] or {"mean": 0.0, "ci": [0.0, 0.0]} for name in names]
        series.append((label, [entry["mean"] for entry in entries], [entry["ci"] for entry in entries]))
    bar_chart(
        "quality_decoding", title, names, series, "share of answers (95 % bootstrap interval)", MAX_LOOP_SHARE
    )


def main() -> None:
    args = parse_args()
    result = run_measurement(run(args))
    for name, entry in result["summary"].items():
        accuracy, delta = entry["accuracy"], entry["accuracy_minus_greedy"]
        print(
            f"{name:24s} accuracy {accuracy['mean']:.3f} {accuracy['ci']} "
            f"vs greedy {delta['mean']:+.3f} {delta['ci']} loops {entry['loops']['mean']:.3f} "
            f"open {(entry['open_loops'] or {'mean': 0.0})['mean']:.3f}"
        )
    print_summary(
        {"chosen": result["chosen"], "identity": result["identity"], "summary": result["summary"]},
        rerun="bench.quality.decoding",
    )


if __name__ == "__main__":
    main()
