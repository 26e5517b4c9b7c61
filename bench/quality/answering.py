"""How ``bench.quality`` and its decoding comparison ask questions and record the answers: through a
fresh controller per configuration (or the engine directly, for prompts no controller builds), every
record with its scores and the tokens the identity checks compare."""

from __future__ import annotations

import argparse
import contextlib
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from bench.common import cpu_seconds, map_bounded
from bench.quality.questions import QualityQuestion, score
from specrag.controller.controller import ControllerConfig, RagController, RagRequest
from specrag.controller.modes import ModeName
from specrag.controller.query import AnswerDelta, AnswerDone
from specrag.pipeline.engines.config import KVEventSource
from specrag.pipeline.engines.protocol import Engine, Sampling
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assembly import open_controller
from specrag.service.run.assets import Assets

__all__ = [
    "PATIENT",
    "Timings",
    "add_answer_options",
    "answer_configuration",
    "ask",
    "controller_config",
    "final_rows",
    "generate",
    "record",
    "timed",
]


def add_answer_options(parser: argparse.ArgumentParser, max_tokens: int, why: str) -> None:
    """How every question is asked (``-k``, ``--max-tokens``, ``why`` its help's end) and how the
    run goes (``--seed``, ``--eager``, ``--concurrency``); a concurrency below 1 is a usage error."""
    parser.add_argument("-k", type=int, default=4, help="passages per prompt (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help=f"answer length cap {why}")
    parser.add_argument("--seed", type=int, default=0, help="question sampling and bootstrap seed")
    parser.add_argument("--eager", action="store_true", help="no graph compilation (faster start)")
    parser.add_argument(
        "--concurrency",
        type=_at_least_one,
        default=8,
        help="questions answered at once, but where an answer must run alone (default %(default)s)",
    )


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


PATIENT: dict[str, Any] = {"first_token_timeout_s": 600.0, "inter_token_timeout_s": 600.0}
"""Liveness timeouts far beyond the service's: this bench judges answers, and on a busy shared
machine a batch of answers can wait seconds for a token; the service's stall detection would then
replace a working engine mid-run."""


async def ask(controller: RagController, request: RagRequest) -> tuple[AnswerDone, tuple[int, ...]]:
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


async def generate(engine: Engine, prompt: Sequence[int], max_tokens: int) -> tuple[str, tuple[int, ...]]:
    """A prompt no controller builds, answered with the decoding a controller's answer gets."""
    penalties: dict[str, Any] = ControllerConfig().default_penalties
    sampling = replace(Sampling(max_tokens=max_tokens), **penalties)
    texts: list[str] = []
    tokens: list[int] = []
    request_id = "quality-" + uuid.uuid4().hex
    async for output in engine.generate(request_id, prompt, sampling):
        texts.append(output.text)
        tokens.extend(output.token_ids)
    return "".join(texts), tuple(tokens)


def final_rows(assets: Assets, done: AnswerDone) -> list[int]:
    """The final top-k as store rows, in retrieval rank order."""
    return [assets.store.row_of(passage_id) for passage_id in done.timeline.documents]


def record(question: QualityQuestion, answer: str, **extra: Any) -> dict[str, Any]:
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
    return record(
        question,
        done.text,
        tokens=list(tokens),
        documents=list(done.timeline.documents),
        gold_retrieved=question.passage_id in done.timeline.documents,
        gold_row=assets.store.row_of(question.passage_id),
        adopted=bool(done.timeline.adopted),
        prompt_rows=list(done.prompt.document_ids()),
        reordered=list(done.prompt.document_ids()) != final_rows(assets, done),
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
    decoding: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Every question answered through a fresh controller over ``index``, ``concurrency`` at once,
    with the request's ``decoding`` fields (none: the controller's); one record a question, in the
    questions' order."""
    async with open_controller(engine, kv_events, index, builder, config) as (controller, _):

        async def one(question: QualityQuestion) -> dict[str, Any]:
            request = RagRequest(question.question, k=args.k, mode=config.mode, max_tokens=args.max_tokens)
            request = replace(request, **(decoding or {}))
            done, tokens = await ask(controller, request)
            return _single_turn_record(assets, question, done, tokens)

        return await map_bounded(one, questions, concurrency)
