"""How long the stand-in's engine steps take: a prefill cost per uncached token, a per-step cost
(reading the weights once a step, which every decode pays), and vLLM's batch limits.

The defaults are Llama-3-8B in bfloat16 on one H100 SXM; docs/capacity.md derives them and names
their sources. A step is vLLM's: its running requests' decodes (one token each) and chunks of
prefills, together at most ``max_num_batched_tokens`` tokens and ``max_num_seqs`` requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from specrag.errors import InvalidInputError

__all__ = ["TimeModel"]


@dataclass(frozen=True)
class TimeModel:
    """Seconds per engine step, and the limits a step keeps."""

    #: Seconds of compute per prompt token the step prefills (not those read from the prefix cache).
    prefill_s_per_token: float = 32e-6
    #: Seconds every step takes whatever it computes: one pass over the weights (a decode step).
    step_s: float = 0.007
    #: Tokens one step computes at most (vLLM's ``max_num_batched_tokens``): a longer prefill is chunked.
    max_num_batched_tokens: int = 8192
    #: Requests running at once at most (vLLM's ``max_num_seqs``); the rest wait.
    max_num_seqs: int = 1024

    def __post_init__(self) -> None:
        if self.prefill_s_per_token < 0 or self.step_s <= 0:
            raise InvalidInputError(
                f"time model: step_s must be positive and prefill_s_per_token not negative, got "
                f"{self.step_s} and {self.prefill_s_per_token}"
            )
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise InvalidInputError(
                f"time model: max_num_batched_tokens and max_num_seqs must be at least 1, got "
                f"{self.max_num_batched_tokens} and {self.max_num_seqs}"
            )

    def step_duration_s(self, prefill_tokens: int) -> float:
        """One step that prefills ``prefill_tokens`` beside its decodes."""
        return self.step_s + prefill_tokens * self.prefill_s_per_token

    def isolated_ttft_s(self, uncached_tokens: int) -> float:
        """A prompt's time to first token alone on the engine: its prefill's steps, chunked."""
        steps = max(1, -(-uncached_tokens // self.max_num_batched_tokens))
        return steps * self.step_s + uncached_tokens * self.prefill_s_per_token
