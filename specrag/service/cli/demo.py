"""The README's main job on the embedded default: real questions through the whole service.

The questions go over HTTP through :class:`AsyncClient` to the service (staged search, speculation,
cache-aware prompts, real vLLM), exactly as a user's application would send them. Each answer is
printed with its sources (the titles of the passages it was generated from, best first) and its
timeline: time to first token, retrieval time and how much of it the prefill did not overlap,
prompt tokens served from the prefix cache, speculations and whether one was adopted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specrag.client import AsyncClient, RagAnswer

__all__ = ["DEMO_QUESTIONS", "SOURCES_SHOWN", "describe", "run_demo"]

DEMO_QUESTIONS = (
    "What happens to assert statements when Python runs with optimization enabled?",
    "How does asyncio.run create and close the event loop?",
    "How can I create a temporary directory that is removed automatically?",
)


SOURCES_SHOWN = 4


def _ms(value: Any) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def describe(question: str, answer: RagAnswer) -> str:
    """One answer and its timeline, for a terminal."""
    timeline = answer.timeline
    titles = [source["title"] for source in answer.sources[:SOURCES_SHOWN]]
    sources = "; ".join(titles) + (" …" if len(answer.sources) > SOURCES_SHOWN else "")
    count = timeline["speculations"]
    speculation = f"{count} speculation{'' if count == 1 else 's'}" + (
        ", one adopted" if timeline["adopted"] else ""
    )
    return (
        f"\nQ: {question}\n"
        f"A: {' '.join(answer.answer.split())}\n"
        f"   sources: {sources}\n"
        f"   TTFT {_ms(timeline['ttft_ms'])} · retrieval {_ms(timeline['retrieval_ms'])}, "
        f"not overlapped {_ms(timeline['non_overlapped_retrieval_ms'])} · "
        f"prompt {timeline['prompt_tokens']} tokens, {timeline['cached_prompt_tokens']} from the "
        f"prefix cache · {speculation}"
    )


async def run_demo(client: AsyncClient, questions: Sequence[str], k: int, max_tokens: int) -> list[RagAnswer]:
    """Ask each question, then the first one again to show the prefix cache at work."""
    answers = []
    for question in [*questions, questions[0]]:
        answer = await client.rag(question, k=k, max_tokens=max_tokens)
        answers.append(answer)
        print(describe(question, answer), flush=True)
    return answers
