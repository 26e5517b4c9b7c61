"""The frontier of document KV: what each way of loading documents costs in accuracy and saves in
cold TTFT, against a full prefill, and the default chosen from it.

A point is a variant (each document's KV computed ``alone`` or ``after-system``) and a tier ``M``
(the top-M documents prefilled fresh after the loaded ones, M = 0 … k). For each point:
``ttft_over_full``, the median cold TTFT over the full prefill's median, measured on the same
prompts in the same run, alternating; and the accuracy with a 95 % bootstrap interval of the paired
difference point − full (the same questions, resampled together). The default is the fastest
point whose paired interval reaches 0 (its upper end ≥ 0) with a lower end ≥ −0.05
(:data:`ACCURACY_FLOOR`); when none does, ``default`` says so instead of naming one.

The accuracy pass answers point after point, each over every question, several questions at once
(:func:`answer_points`): vLLM batches their decode steps, which on a CPU cost little more than one
sequence's, while each question keeps its own sequence (full prefill first, then its documents
stored, then the point). Point by point, so that ``--quick`` can stop at the first point that
qualifies when the points come fastest first: that point is then the default, and the slower ones
are marked as not measured instead of costing hours.

Engine-agnostic: :func:`measure_ttft` and :func:`answer_frontier` take any engine with document KV
(the real one in :mod:`bench.pipeline.turbo`, the simulated one in the tests) and a ``fill`` that
stores what a prompt will load.
"""

from __future__ import annotations

import contextlib
import statistics
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.common import bootstrap_mean_ci, map_bounded
from bench.quality.questions import score
from specrag.cache.layout import PromptLayout
from specrag.controller.controller import AnswerDone, ControllerConfig, RagRequest
from specrag.controller.modes import DocumentKvVariant, ModeName
from specrag.controller.tiers import document_kv_sampling, fresh_last
from specrag.pipeline.engines.protocol import Engine, Sampling, now
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assembly import open_controller

ACCURACY_FLOOR = -0.05
"""The lowest acceptable lower end of a default's paired accuracy interval (point − full)."""
FULL = "full"
QUICK_STOP_NOTE = "not measured: --quick stops at the first qualifying point"
NO_QUESTIONS_NOTE = "not measured: no questions (--questions 0)"
ANSWER_TIMEOUT_S = 900.0
"""The accuracy pass's first- and inter-token timeouts: a question waits its turn behind the other
questions' prefills (on a busy CPU, minutes), which the service's one-minute timeout would take for
a hung engine; this pass measures answers, not their latency."""

Fill = Callable[[Sequence[int], Sampling], Awaitable[object]]
"""Stores the spans a prompt's sampling will load (the real engine's ``fill_prompt_kv``)."""
Answer = Callable[[int, "Point | None"], Awaitable[dict[str, Any]]]
"""Answers question ``i`` in full (``None``) or at a point; its record (``accuracy`` among it)."""


@dataclass(frozen=True)
class Point:
    """One way of serving a prompt with document KV."""

    variant: DocumentKvVariant
    fresh: int

    @property
    def name(self) -> str:
        return f"{self.variant}/fresh={self.fresh}"

    def layout(self, builder: PromptBuilder, rows: Sequence[int], question: str) -> PromptLayout:
        """The prompt of ``rows`` (in rank order) with this point's top documents last."""
        return builder.build(fresh_last(rows, rows, self.fresh), question)

    def sampling(self, layout: PromptLayout, sampling: Sampling) -> Sampling:
        after_system = self.variant is DocumentKvVariant.AFTER_SYSTEM
        return document_kv_sampling(sampling, layout, self.fresh, after_system=after_system)


def frontier_points(k: int, tiers: Sequence[int] | None = None) -> list[Point]:
    """Every variant with M = 0 … k, or with the given ``tiers`` only (a partial frontier)."""
    chosen = range(k + 1) if tiers is None else tiers
    if not all(0 <= fresh <= k for fresh in chosen):
        raise ValueError(f"tiers must lie between 0 and k = {k}, got {list(chosen)}")
    return [Point(variant, fresh) for variant in DocumentKvVariant for fresh in chosen]


async def first_output(engine: Engine, prompt: Sequence[int], sampling: Sampling) -> tuple[float, int, int]:
    """(seconds to the first token, cached tokens, first token) of one request."""
    started = now()
    async for output in engine.generate(uuid.uuid4().hex, prompt, sampling):
        if output.token_ids:
            return output.received_at - started, output.cached_tokens or 0, output.token_ids[0]
    raise RuntimeError("the engine returned no token")


async def measure_ttft(
    engine: Engine,
    builder: PromptBuilder,
    prompts: Sequence[tuple[Sequence[int], str]],
    points: Sequence[Point],
    repeats: int,
    fill: Fill,
) -> dict[str, Any]:
    """Cold TTFT (prefix cache reset before each request) of every prompt ``(rows, question)``
    served in full and at every point; the order of the ways rotates from prompt to prompt.

    Each point's spans are stored first (``fill``), so every measured request loads them all.
    """
    one_token = Sampling(max_tokens=1)
    ways: list[tuple[str, list[tuple[Sequence[int], Sampling]]]] = [
        (FULL, [(builder.build(rows, question).token_ids, one_token) for rows, question in prompts])
    ]
    for point in points:
        served: list[tuple[Sequence[int], Sampling]] = []
        for rows, question in prompts:
            layout = point.layout(builder, rows, question)
            sampling = point.sampling(layout, one_token)
            await fill(layout.token_ids, sampling)
            served.append((layout.token_ids, sampling))
        ways.append((point.name, served))
    seconds: dict[str, list[float]] = {name: [] for name, _ in ways}
    loaded: dict[str, list[int]] = {name: [] for name, _ in ways}
    turn = 0
    for _ in range(repeats):
        for index in range(len(prompts)):
            turn += 1
            for name, served in ways[turn % len(ways) :] + ways[: turn % len(ways)]:
                prompt, sampling = served[index]
                await engine.reset_prefix_cache()
                elapsed, cached, _ = await first_output(engine, prompt, sampling)
                seconds[name].append(elapsed)
                loaded[name].append(cached)
    return {"seconds": seconds, "cached_tokens": loaded}


async def answer_points(
    count: int,
    points: Sequence[Point],
    answer: Answer,
    *,
    concurrency: int,
    stop_at_first: bool = False,
) -> list[dict[str, Any]]:
    """One record a question: full prefill's answer, then each point's, point after point in the
    given order, at most ``concurrency`` questions at once.

    With ``stop_at_first``, no point after the first that :func:`qualifies` is answered: given the
    points fastest first, that one is the default, and the records of the rest lack their names.
    """
    records: list[dict[str, Any]] = [{} for _ in range(count)]
    started = now()
    for point in (None, *points):

        async def one(question: int, point: Point | None = point) -> dict[str, Any]:
            return await answer(question, point)

        name = FULL if point is None else point.name
        for record, answered in zip(records, await map_bounded(one, range(count), concurrency), strict=True):
            record[name] = answered
        if point is None:
            continue
        paired = paired_accuracy(records, point.name)
        low, high = paired["accuracy_diff_ci"]
        print(  # progress: a long pass, point after point
            f"answered {point.name} on {count} questions ({now() - started:.0f} s in): "
            f"− full {paired['accuracy_diff']:+.3f} [{low:.3f}, {high:.3f}]",
            flush=True,
        )
        if stop_at_first and qualifies(paired):
            break
    return records


async def answer_frontier(
    engine: Engine,
    builder: PromptBuilder,
    index: VectorIndex,
    pairs: Sequence[tuple[str, str]],
    k: int,
    max_tokens: int,
    points: Sequence[Point],
    fill: Fill,
    *,
    concurrency: int,
    stop_at_first: bool = False,
) -> list[dict[str, Any]]:
    """The accuracy hook: (question, gold answer) pairs answered through the controller in full
    and at the points (:func:`answer_points`), scored by ``bench.quality``'s metrics; one record
    a question.

    Every way runs as a ``serial`` request (search, then one prompt, documents in retrieval order
    but for a point's fresh ones, moved last), greedy. Before a question's turbo request its
    documents are stored (``fill``) in the point's variant, so it loads all it may
    (``loaded_tokens``). The prefix cache stays on: turbo requests run under their own salts.
    """
    fulls: dict[int, AnswerDone] = {}
    async with contextlib.AsyncExitStack() as stack:
        controllers = {}
        for variant in DocumentKvVariant:
            config = ControllerConfig(
                mode=ModeName.SERIAL,
                document_kv_variant=variant,
                first_token_timeout_s=ANSWER_TIMEOUT_S,
                inter_token_timeout_s=ANSWER_TIMEOUT_S,
            )
            controller, _ = await stack.enter_async_context(
                open_controller(engine, None, index, builder, config)
            )
            controllers[variant] = controller

        async def answer(question: int, point: Point | None) -> dict[str, Any]:
            text, gold = pairs[question]
            if point is None:
                request = RagRequest(text, k=k, max_tokens=max_tokens, document_kv="full")
                full = fulls[question] = await controllers[DocumentKvVariant.ALONE].answer(request)
                return {"answer": full.text, **score(full.text, gold)}
            full = fulls[question]
            await fill(full.prompt.token_ids, Point(point.variant, 0).sampling(full.prompt, Sampling()))
            request = RagRequest(
                text, k=k, max_tokens=max_tokens, document_kv="turbo", document_kv_fresh=point.fresh
            )
            done = await controllers[point.variant].answer(request)
            return {
                "answer": done.text,
                **score(done.text, gold),
                "loaded_tokens": done.timeline.document_kv_tokens,
                "same_as_full": done.text == full.text,
            }

        records = await answer_points(
            len(pairs), points, answer, concurrency=concurrency, stop_at_first=stop_at_first
        )
    return [
        {"question": text, "gold": gold, **record}
        for (text, gold), record in zip(pairs, records, strict=True)
    ]


def fastest_first(ttft: Mapping[str, Any], points: Sequence[Point]) -> list[Point]:
    """``points`` by their median cold TTFT, fastest first: the order ``--quick`` answers them in."""
    return sorted(points, key=lambda point: statistics.median(ttft["seconds"][point.name]))


def paired_accuracy(records: Sequence[Mapping[str, Any]], name: str, seed: int = 0) -> dict[str, Any]:
    """``name``'s accuracy over ``records`` (one a question) and its paired difference to full,
    each with a 95 % bootstrap interval over questions."""
    rng = np.random.default_rng(seed)
    full = np.array([record[FULL]["accuracy"] for record in records], dtype=float)
    point = np.array([record[name]["accuracy"] for record in records], dtype=float)
    return {
        "accuracy": float(point.mean()),
        "accuracy_ci": bootstrap_mean_ci(point, rng),
        "accuracy_diff": float((point - full).mean()),
        "accuracy_diff_ci": bootstrap_mean_ci(point - full, rng),
    }


def frontier(
    ttft: Mapping[str, Any], records: Sequence[Mapping[str, Any]], points: Sequence[Point]
) -> list[dict[str, Any]]:
    """Each point's TTFT over full prefill's (medians) and its paired accuracy; a point the records
    lack (none asked, or ``--quick`` stopped before it) has ``None`` there and a note saying so."""
    full_median = statistics.median(ttft["seconds"][FULL])
    rows = []
    for point in points:
        seconds = ttft["seconds"][point.name]
        row: dict[str, Any] = {
            "name": point.name,
            "variant": str(point.variant),
            "fresh": point.fresh,
            "ttft_ms": statistics.median(seconds) * 1000,
            "ttft_p99_ms": float(np.percentile(seconds, 99)) * 1000,
            "ttft_over_full": statistics.median(seconds) / full_median,
        }
        if records and all(point.name in record for record in records):
            row |= paired_accuracy(records, point.name)
        else:
            row |= dict.fromkeys(("accuracy", "accuracy_ci", "accuracy_diff", "accuracy_diff_ci"))
            row["accuracy_note"] = QUICK_STOP_NOTE if records else NO_QUESTIONS_NOTE
        rows.append(row)
    return rows


def qualifies(row: Mapping[str, Any], floor: float = ACCURACY_FLOOR) -> bool:
    """Whether a measured point's paired interval reaches 0 with a lower end ≥ ``floor``."""
    interval = row.get("accuracy_diff_ci")
    return interval is not None and interval[1] >= 0 and interval[0] >= floor


def choose_default(points: Sequence[Mapping[str, Any]], floor: float = ACCURACY_FLOOR) -> dict[str, Any]:
    """The fastest point whose paired interval reaches 0 with a lower end ≥ ``floor``; when none
    does (or no accuracy was measured), ``name`` None and a ``statement`` saying so."""
    eligible = [point for point in points if qualifies(point, floor)]
    if not eligible:
        return {
            "name": None,
            "ttft_over_full": None,
            "accuracy_diff_ci": None,
            "statement": f"no point's paired accuracy interval reaches 0 with a lower end >= {floor}",
        }
    best = min(eligible, key=lambda point: point["ttft_over_full"])
    return {key: best[key] for key in ("name", "ttft_over_full", "accuracy_diff_ci")}
