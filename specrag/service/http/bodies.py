"""The JSON bodies the HTTP API accepts: which fields each endpoint knows, the JSON type of each,
and the :class:`~specrag.controller.query.RagRequest` a body asks for.

Only the shape is checked here (a field's JSON type, fields that do not exist or that this service
cannot honour); what a value means (``k``'s range, a mode's name) is the query core's to check,
once, so the message names the JSON field either way.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import Any, TypeVar, cast

from specrag.controller.query import RagRequest
from specrag.errors import ECHO_LIMIT, InvalidInputError, echo

__all__ = [
    "BATCH_FIELDS",
    "CHAT_FIELDS",
    "CHAT_NEUTRAL_FIELDS",
    "CHAT_UNHONOURED_FIELDS",
    "FIELD_ALIASES",
    "HINT_SIMILARITY",
    "PENALTY_FIELDS",
    "RAG_FIELDS",
    "STREAM_OPTIONS",
    "chat_request",
    "check_fields",
    "field_hint",
    "include_usage",
    "optional",
    "rag_request",
    "required",
    "user_questions",
]

# The penalties against repetition: OpenAI's two and vLLM's extension, on both question APIs
# (docs/service.md: "Sampling fields"); ranges and engine support are the query core's to check.
PENALTY_FIELDS = frozenset({"frequency_penalty", "presence_penalty", "repetition_penalty"})
RAG_FIELDS = frozenset(
    {
        "query",
        "k",
        "mode",
        "document_kv",
        "document_kv_fresh",
        "max_tokens",
        "session_id",
        "stream",
        "allow_partial",
        *PENALTY_FIELDS,
    }
)
BATCH_FIELDS = frozenset({"queries", "k", "mode", "max_tokens", "allow_partial"})
# The OpenAI chat fields honoured (docs/service.md: "Sampling fields") and the JSON type each must have,
# whatever else the body holds; ``float`` takes any number. ``stop`` and ``messages`` are checked
# by their own code.
CHAT_FIELDS: dict[str, type] = {
    "model": str,
    "user": str,
    "stream": bool,
    "stream_options": dict,
    "max_tokens": int,
    "max_completion_tokens": int,
    "temperature": float,
    "top_p": float,
    "seed": int,
    "k": int,
    "mode": str,
    "document_kv": str,
    "document_kv_fresh": int,
    "session_id": str,
    "allow_partial": bool,
    **dict.fromkeys(sorted(PENALTY_FIELDS), float),
}
# Fields accepted at their neutral value only (the type of the value, the value).
CHAT_NEUTRAL_FIELDS: dict[str, tuple[type, Any]] = {
    "n": (int, 1),
    "logprobs": (bool, False),
    "store": (bool, False),
    "response_format": (dict, {"type": "text"}),
}
# OpenAI's other chat fields: what they ask for (tool calls, structured output, audio, token
# biases, ...) this service cannot do, so setting one is a 400 naming it. Sent as null, these and
# every other optional field are absent, as OpenAI reads them (some client libraries send nulls).
CHAT_UNHONOURED_FIELDS = frozenset(
    {
        *("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "logit_bias"),
        *("top_logprobs", "audio", "modalities", "prediction", "web_search_options", "metadata"),
        *("reasoning_effort", "verbosity", "service_tier", "prompt_cache_key", "safety_identifier"),
    }
)
STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})
# What other RAG and search APIs call the fields these bodies know: too far apart in spelling for
# difflib to find, so named here.
FIELD_ALIASES = {
    "question": "query",
    "prompt": "query",
    "q": "query",
    "text": "query",
    "questions": "queries",
    "top_k": "k",
    "topk": "k",
    "num_documents": "k",
    "max_new_tokens": "max_tokens",
    "conversation_id": "session_id",
}
# How alike a misspelt field's name must be to a known one (difflib's ratio) to be offered: a
# typo ("querry", "sessionid") passes, an unrelated word that shares letters does not.
HINT_SIMILARITY = 0.75

T = TypeVar("T")


def check_fields(body: dict[str, Any], known: AbstractSet[str], what: str) -> None:
    """400 naming the fields not in ``known`` (at most ten of them, each cut short), each with the
    known field it most likely meant, if any (:func:`field_hint`)."""
    unknown = sorted(set(body) - known)
    if unknown:
        names = [_named_with_hint(name, known) for name in unknown[:10]]
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        raise InvalidInputError(f"{what}: {', '.join(names)}{more}")


def field_hint(name: str, known: AbstractSet[str]) -> str | None:
    """The known field ``name`` most likely meant: the one other APIs call so, or the closest in
    spelling (difflib's ratio at least :data:`HINT_SIMILARITY`); None when none is close."""
    alias = FIELD_ALIASES.get(name.lower())
    if alias in known:
        return alias
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=HINT_SIMILARITY)
    return close[0] if close else None


def _named_with_hint(name: str, known: AbstractSet[str]) -> str:
    if len(name) > ECHO_LIMIT:
        return echo(name)
    hint = field_hint(name, known)
    return name if hint is None else f"{name} (did you mean '{hint}'?)"


_KIND_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    list: "a list",
    dict: "an object",
}


def optional(body: dict[str, Any], name: str, kind: type[T]) -> T | None:
    """``body[name]`` if present and of exactly this JSON type (an int is not a bool here; for
    ``float``, any number)."""
    value = body.get(name)
    if value is None:
        return None
    accepted: tuple[type, ...] = (int, float) if kind is float else (kind,)
    if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
        raise InvalidInputError(f"'{name}' must be {_KIND_NAMES[kind]}, got {type(value).__name__}")
    return cast(T, value)


def required(body: dict[str, Any], name: str, kind: type[T]) -> T:
    value = optional(body, name, kind)
    if value is None:
        raise InvalidInputError(f"'{name}' is required")
    return value


def rag_request(body: dict[str, Any], question: str, max_tokens: int | None) -> RagRequest:
    """The options both APIs share (``k``, ``mode``, ``document_kv``, ``document_kv_fresh``,
    ``session_id``, ``allow_partial`` and the penalties)."""
    return RagRequest(
        question=question,
        k=optional(body, "k", int),
        mode=optional(body, "mode", str),
        document_kv=optional(body, "document_kv", str),
        document_kv_fresh=optional(body, "document_kv_fresh", int),
        max_tokens=max_tokens,
        session_id=optional(body, "session_id", str),
        allow_partial=bool(optional(body, "allow_partial", bool)),
        frequency_penalty=optional(body, "frequency_penalty", float),
        presence_penalty=optional(body, "presence_penalty", float),
        repetition_penalty=optional(body, "repetition_penalty", float),
    )


def chat_request(body: dict[str, Any]) -> RagRequest:
    """A chat body's request: the shared options and the sampling fields (docs/service.md,
    "Sampling fields").

    Every field present is checked on its own, so that no field's presence hides another's
    mistake; a field set to null is absent.
    """
    known = CHAT_FIELDS.keys() | CHAT_NEUTRAL_FIELDS.keys() | CHAT_UNHONOURED_FIELDS | {"messages", "stop"}
    check_fields(body, known, "unsupported fields")
    for name in sorted(CHAT_UNHONOURED_FIELDS & body.keys()):
        if body[name] is not None:
            raise InvalidInputError(
                f"'{name}' is not supported: specrag answers from the documents it retrieves"
            )
    for name, kind in CHAT_FIELDS.items():
        optional(body, name, kind)
    for name, (kind, neutral) in CHAT_NEUTRAL_FIELDS.items():
        value = optional(body, name, kind)
        if value is not None and value != neutral:
            raise InvalidInputError(f"'{name}' is not supported: only {json.dumps(neutral)} is accepted")
    include_usage(body)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str | list):
        raise InvalidInputError(f"'stop' must be a string or a list of strings, got {type(stop).__name__}")
    *previous, question = user_questions(required(body, "messages", list))
    max_tokens = optional(body, "max_completion_tokens", int)  # OpenAI's name now; max_tokens before
    if max_tokens is None:
        max_tokens = optional(body, "max_tokens", int)
    return replace(
        rag_request(body, question, max_tokens),
        temperature=optional(body, "temperature", float),
        top_p=optional(body, "top_p", float),
        seed=optional(body, "seed", int),
        stop=stop,
        previous_questions=tuple(previous),
    )


def include_usage(body: dict[str, Any]) -> bool:
    """``stream_options.include_usage``: whether a streamed answer ends with OpenAI's usage chunk."""
    options = optional(body, "stream_options", dict) or {}
    check_fields(options, STREAM_OPTIONS, "unsupported stream_options")
    return bool(optional(options, "include_usage", bool))


def user_questions(messages: list[Any]) -> list[str]:
    """The user messages' texts, oldest first: the last is the question RAG answers, those before
    it the conversation a follow-up is searched with (an earlier one that is not text is left out)."""
    if not messages:
        raise InvalidInputError("'messages' must not be empty")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidInputError(f"messages[{index}] must be an object with a string 'role'")
    users = [message for message in messages if message["role"] == "user"]
    if not users:
        raise InvalidInputError("'messages' has no user message")
    question = _text(users[-1].get("content"))
    if question is None:
        raise InvalidInputError("the last user message's 'content' must be a string or a list of text parts")
    earlier = [_text(message.get("content")) for message in users[:-1]]
    return [*(text for text in earlier if text is not None), question]


def _text(content: Any) -> str | None:
    """A message's text: its string content or its text parts joined; None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "\n".join(part["text"] for part in content)
    return None
