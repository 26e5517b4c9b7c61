"""How an answer is written: the ``/v1/rag`` body, and a streamed answer as server-sent events in
specrag's own framing or OpenAI's ``chat.completion.chunk`` lines (whose last chunk carries the usage
and the timeline)."""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from specrag.controller.query import AnswerDelta, AnswerDone
from specrag.service.http.wire import ErrorInfo

__all__ = ["ChatFraming", "Framing", "RagFraming", "rag_body", "sse", "usage"]


class Framing(Protocol):
    """How one API writes a streamed answer as server-sent events."""

    def delta(self, delta: AnswerDelta) -> bytes: ...

    def done(self, done: AnswerDone, completion_tokens: int) -> bytes: ...

    def error(self, info: ErrorInfo) -> bytes: ...


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


def rag_body(done: AnswerDone) -> dict[str, Any]:
    return {
        "answer": done.text,
        "finish_reason": done.finish_reason,
        "documents": list(done.timeline.documents),
        "sources": [source._asdict() for source in done.sources],
        "specrag": done.timeline.to_dict(),
    }


class RagFraming:
    def delta(self, delta: AnswerDelta) -> bytes:
        return sse({"text": delta.text}, "delta")

    def done(self, done: AnswerDone, completion_tokens: int) -> bytes:
        return sse(rag_body(done), "done")

    def error(self, info: ErrorInfo) -> bytes:
        return sse({**info.body(), "status": info.status}, "error")


def usage(done: AnswerDone, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": done.timeline.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": done.timeline.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.timeline.cached_prompt_tokens},
    }


class ChatFraming:
    """OpenAI ``chat.completion.chunk`` lines; the last chunk carries usage and the timeline.

    With ``stream_options.include_usage`` the last chunk is OpenAI's: empty ``choices``, after the
    chunk with the finish reason; without it usage rides on that chunk (a client that reads
    ``choices[0]`` of every chunk would fail on an empty list it did not ask for).
    """

    def __init__(self, completion_id: str, model: str, usage_chunk: bool = False) -> None:
        self._head = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        self._role_sent = False
        self._usage_chunk = usage_chunk

    def _chunk(self, delta: dict[str, str], finish_reason: str | None = None, **extra: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return sse({**self._head, "choices": [choice], **extra})

    def delta(self, delta: AnswerDelta) -> bytes:
        content = {"content": delta.text}
        if not self._role_sent:
            self._role_sent = True
            content = {"role": "assistant", **content}
        return self._chunk(content)

    def done(self, done: AnswerDone, completion_tokens: int) -> bytes:
        end = {"usage": usage(done, completion_tokens), "specrag": done.timeline.to_dict()}
        finish_reason = done.finish_reason or "stop"
        if self._usage_chunk:
            last = self._chunk({}, finish_reason) + sse({**self._head, "choices": [], **end})
        else:
            last = self._chunk({}, finish_reason, **end)
        return last + sse("[DONE]")

    def error(self, info: ErrorInfo) -> bytes:
        return sse(info.body()) + sse("[DONE]")
