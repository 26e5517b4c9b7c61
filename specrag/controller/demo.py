"""The README's main job on the embedded default: real questions through retrieval and real vLLM.

It prints, per answer, the retrieval time, the time to first token and how many prompt tokens the
engine's prefix cache served. The default model has random weights, so the answers' text is noise;
the latencies are real.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from specrag.controller.assets import Assets
from specrag.pipeline.engine import Engine, Sampling, now
from specrag.pipeline.prompt import PromptBuilder

DEMO_QUESTIONS = (
    "What happens to assert statements when Python runs with optimization enabled?",
    "How does asyncio.run create and close the event loop?",
    "How can I create a temporary directory that is removed automatically?",
)


@dataclass(frozen=True)
class DemoAnswer:
    question: str
    passages: list[str]
    retrieval_ms: float
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    answer: str


async def answer(
    engine: Engine, assets: Assets, builder: PromptBuilder, question: str, k: int, sampling: Sampling
) -> DemoAnswer:
    """Serial RAG for one question: search, build the prompt from stored tokens, prefill, decode."""
    started = now()
    vector = assets.index.embed_query(question)
    _, rows = assets.index.search(vector[None, :], k)
    passages = [int(p) for p in assets.index.passage_index_of(rows[0]) if p >= 0]
    searched = now()
    prompt = builder.build(passages, question)
    submitted = now()
    first_token_at: float | None = None
    cached = 0
    token_ids: list[int] = []
    async for output in engine.generate(uuid.uuid4().hex, prompt.token_ids, sampling):
        if first_token_at is None:
            first_token_at = output.received_at
            cached = output.cached_tokens or 0
        token_ids.extend(output.token_ids)
    assert first_token_at is not None, "the engine finished without producing a token"
    return DemoAnswer(
        question=question,
        passages=[assets.store.passage(row).id for row in passages],
        retrieval_ms=(searched - started) * 1000,
        ttft_ms=(first_token_at - submitted) * 1000,
        prompt_tokens=len(prompt.token_ids),
        cached_tokens=cached,
        answer=builder.tokenizer.decode(token_ids),
    )


async def run_demo(
    engine: Engine, assets: Assets, questions: Sequence[str], k: int, max_tokens: int
) -> list[DemoAnswer]:
    """Answer each question, then the first one again to show the prefix cache at work."""
    builder = PromptBuilder(assets.tokenizer, assets.store, block_size=engine.block_size)
    sampling = Sampling(max_tokens=max_tokens)
    answers = []
    for question in [*questions, questions[0]]:
        result = await answer(engine, assets, builder, question, k, sampling)
        answers.append(result)
        print(
            f"\nQ: {result.question}\n"
            f"   retrieved: {', '.join(result.passages[:4])}{' …' if len(result.passages) > 4 else ''}\n"
            f"   retrieval {result.retrieval_ms:.1f} ms · TTFT {result.ttft_ms:.0f} ms · "
            f"prompt {result.prompt_tokens} tokens, {result.cached_tokens} served from the prefix cache\n"
            f"   A (random-weight model, text is noise): {result.answer[:120]!r}",
            flush=True,
        )
    return answers
