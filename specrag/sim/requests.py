"""What the simulated engine computes with: its time model, its requests, their synthetic answers."""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from specrag.cache.pgdsf import PrefillProfile
from specrag.errors import EngineError, InvalidInputError
from specrag.pipeline.engines.protocol import EngineOutput, Sampling

__all__ = ["SimRequest", "TimeModel", "synthetic_answer"]


@dataclass(frozen=True)
class TimeModel:
    """How long one engine step takes, in unscaled seconds.

    Prefill cost comes from the cache layer's measured profile: computing tokens
    ``[cached, cached + new)`` costs ``cold(cached + new) - cold(cached)``, so a partly cached
    prompt saves less than its cached share (attention makes later tokens dearer).
    """

    prefill: PrefillProfile = field(default_factory=PrefillProfile)
    decode_step_s: float = 0.01
    step_overhead_s: float = 0.005

    def __post_init__(self) -> None:
        if self.decode_step_s < 0 or self.step_overhead_s < 0:
            raise InvalidInputError("decode_step_s and step_overhead_s must be >= 0")


@dataclass(eq=False)
class SimRequest:
    """A request inside the simulated engine; ``tokens`` grows with every sampled token."""

    request_id: str
    tokens: list[int]
    prompt_tokens: int
    sampling: Sampling
    answer: list[tuple[int, str]]
    end_reason: str
    keys: list[int]
    root: int  # the chain's parent key: the unsalted root, or its cache salt's
    outputs: asyncio.Queue[EngineOutput | EngineError] = field(default_factory=asyncio.Queue)
    computed: int = 0
    registered: int = 0
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int | None = None
    loaded_tokens: int = 0  # of the cached tokens, those loaded as document KV
    scheduled_at: float | None = None
    aborted: bool = False

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_tokens


def synthetic_answer(
    prompt: Sequence[int], sampling: Sampling, vocab_size: int
) -> tuple[list[tuple[int, str]], str]:
    """The synthetic completion, a function of the prompt and the seed only: (token, text) pairs
    and the finish reason; like vLLM, it ends with the token that completes a stop string, and
    the text stops before that string."""
    digest = hashlib.blake2b(repr((tuple(prompt), sampling.seed)).encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "big"))
    tokens = [rng.randrange(3, vocab_size) for _ in range(sampling.max_tokens)]
    texts = [f" t{token}" for token in tokens]
    full = "".join(texts)
    hits = [(at, len(stop)) for stop in sampling.stop if (at := full.find(stop)) >= 0]
    if not hits:
        return list(zip(tokens, texts, strict=True)), "length"
    cut, length = min(hits)
    answer, offset = [], 0
    for token, text in zip(tokens, texts, strict=True):
        answer.append((token, text[: max(0, cut - offset)]))
        offset += len(text)
        if offset >= cut + length:
            break
    return answer, "stop"
