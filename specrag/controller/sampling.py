"""A request's decoding settings, checked the way OpenAI checks them.

Only what every engine adapter honours is accepted: temperature, top_p, seed, stop strings and the
number of output tokens. Decoding is greedy unless a temperature says otherwise (OpenAI's default
is 1; greedy keeps an adopted speculation's answer identical to the serial one). Types are
checked here too, not only by the HTTP layer: the controller is a public entry point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specrag.controller.query import RagRequest
from specrag.errors import InvalidInputError, echo
from specrag.pipeline.engines.protocol import Sampling

__all__ = ["MAX_SEED", "MAX_STOP_CHARS", "MAX_STOP_SEQUENCES", "MAX_TEMPERATURE", "check_sampling"]

MAX_TEMPERATURE = 2.0
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 200
MAX_SEED = 2**63 - 1


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInputError(f"{name} must be a number, got {echo(value)}")
    if not math.isfinite(value):
        raise InvalidInputError(f"{name} must be a finite number, got {echo(value)}")
    return float(value)


def _stop(value: str | Sequence[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = (value,) if isinstance(value, str) else value
    if not isinstance(stops, list | tuple) or not all(isinstance(stop, str) for stop in stops):
        raise InvalidInputError(f"stop must be a string or a list of strings, got {echo(value)}")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise InvalidInputError(f"stop takes at most {MAX_STOP_SEQUENCES} strings, got {len(stops)}")
    if not all(0 < len(stop) <= MAX_STOP_CHARS for stop in stops):
        raise InvalidInputError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return tuple(stops)


def check_sampling(request: RagRequest, max_tokens: int) -> Sampling:
    """The request's :class:`Sampling` (a ``None`` field takes the default), or InvalidInputError."""
    temperature, top_p, seed = request.temperature, request.top_p, request.seed
    checked_temperature = 0.0 if temperature is None else _number("temperature", temperature)
    if not 0 <= checked_temperature <= MAX_TEMPERATURE:
        raise InvalidInputError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {temperature}")
    checked_top_p = 1.0 if top_p is None else _number("top_p", top_p)
    if not 0 < checked_top_p <= 1:
        raise InvalidInputError(f"top_p must be greater than 0 and at most 1, got {top_p}")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED
    ):
        raise InvalidInputError(f"seed must be an integer between 0 and 2**63 - 1, got {echo(seed)}")
    return Sampling(
        max_tokens=max_tokens,
        temperature=checked_temperature,
        top_p=checked_top_p,
        seed=seed,
        stop=_stop(request.stop),
    )
