"""A request's decoding settings, checked the way OpenAI checks them.

Only what every engine adapter honours is accepted: temperature, top_p, seed, stop strings and the
number of output tokens; and the penalties against repetition (OpenAI's ``frequency_penalty`` and
``presence_penalty``, vLLM's ``repetition_penalty``) where every engine applies them. Decoding is
greedy unless a temperature says otherwise (OpenAI's default is 1; greedy keeps an adopted
speculation's answer identical to the serial one, and so do penalties, which are a function of
the prompt and the tokens so far). Types are checked here too, not only by the HTTP layer: the
controller is a public entry point.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from specrag.controller.query import RagRequest
from specrag.errors import InvalidInputError, echo
from specrag.pipeline.engines.protocol import MAX_PENALTY, Sampling

__all__ = [
    "MAX_SEED",
    "MAX_STOP_CHARS",
    "MAX_STOP_SEQUENCES",
    "MAX_TEMPERATURE",
    "NEUTRAL_PENALTIES",
    "check_penalty",
    "check_sampling",
]

MAX_TEMPERATURE = 2.0
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 200
MAX_SEED = 2**63 - 1
NEUTRAL_PENALTIES: Mapping[str, float] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
}
"""Each penalty's value that changes nothing: what a request gets on an engine without penalties."""


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInputError(f"{name} must be a number, got {echo(value)}")
    if not math.isfinite(value):
        raise InvalidInputError(f"{name} must be a finite number, got {echo(value)}")
    return float(value)


def check_penalty(name: str, value: object, spelled: str | None = None) -> float:
    """``value`` of the penalty ``name`` (a key of :data:`NEUTRAL_PENALTIES`) as a float, or
    InvalidInputError naming it ``spelled`` (a flag, say) or ``name``: OpenAI's two within
    −2..2, vLLM's ``repetition_penalty`` above 0."""
    label = spelled or name
    checked = _number(label, value)
    if name == "repetition_penalty":
        if not checked > 0:
            raise InvalidInputError(f"{label} must be greater than 0, got {value}")
    elif not -MAX_PENALTY <= checked <= MAX_PENALTY:
        raise InvalidInputError(f"{label} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, got {value}")
    return checked


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


def check_sampling(
    request: RagRequest, max_tokens: int, default_penalties: Mapping[str, float] = NEUTRAL_PENALTIES
) -> Sampling:
    """The request's :class:`Sampling` (a ``None`` field takes the default; a penalty the request
    leaves unset, ``default_penalties``'), or InvalidInputError."""
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

    def penalty(name: str) -> float:
        asked = getattr(request, name)
        if asked is None:
            return default_penalties.get(name, NEUTRAL_PENALTIES[name])
        return check_penalty(name, asked)

    return Sampling(
        max_tokens=max_tokens,
        temperature=checked_temperature,
        top_p=checked_top_p,
        seed=seed,
        stop=_stop(request.stop),
        frequency_penalty=penalty("frequency_penalty"),
        presence_penalty=penalty("presence_penalty"),
        repetition_penalty=penalty("repetition_penalty"),
    )
