"""Open-loop Poisson arrivals against a front end's ``POST /v1/rag`` (streamed), each answer timed.

Open loop: every question is sent at its arrival time whether or not earlier ones were answered,
so an overloaded front shows as growing latency and failures rather than as a slower client.
The time to first token is the client's: from sending the request to the first ``delta`` event.
The answer's engine request id comes from the ``done`` event (the service's timeline names the
request it adopted or submitted last; the thin front names its one request), so that the
stand-in's own time for exactly that request can be subtracted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

__all__ = ["Answer", "offer"]

ANSWER_TIMEOUT_S = 30.0


@dataclass
class Answer:
    """One question's outcome as the client saw it."""

    sent_at: float
    send_late_s: float = 0.0  # after its arrival time: the load generator's own delay
    ttft_s: float | None = None
    done_s: float | None = None
    request_id: str | None = None
    predicted_cached: int | None = None
    delivered_cached: int | None = None
    unstaged: bool | None = None  # specrag's search ran in one stage (None: the thin front's answer)
    error: str | None = None


def answer_request_id(done: dict[str, Any]) -> str | None:
    """The engine request an answer came from: the thin front's own, or the timeline's last
    ``adopt``/``final_submit`` (a retry or migration submits again: the last one answered)."""
    if "request_id" in done:
        return str(done["request_id"])
    events = done.get("specrag", {}).get("events", [])
    ids = [event["request_id"] for event in events if event.get("kind") in ("adopt", "final_submit")]
    return ids[-1] if ids else None


async def _ask(session: aiohttp.ClientSession, url: str, body: dict[str, Any], answer: Answer) -> None:
    try:
        async with asyncio.timeout(ANSWER_TIMEOUT_S), session.post(url, json=body) as response:
            if response.status != 200:
                answer.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            event, buffer = "", b""
            async for data in response.content.iter_any():
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.startswith(b"event:"):
                        event = line[6:].strip().decode()
                    elif line.startswith(b"data:"):
                        _record(answer, event, json.loads(line[5:]))
        if answer.done_s is None and answer.error is None:
            answer.error = "the stream ended without its done event"
    except (TimeoutError, aiohttp.ClientError, ValueError) as error:
        answer.error = f"{type(error).__name__}: {error}"


def _record(answer: Answer, event: str, data: dict[str, Any]) -> None:
    now = time.perf_counter() - answer.sent_at
    if event == "delta" and answer.ttft_s is None:
        answer.ttft_s = now
    elif event == "done":
        answer.done_s = now
        answer.request_id = answer_request_id(data)
        timeline = data.get("specrag") or {}
        answer.predicted_cached = timeline.get("predicted_cached_tokens")
        answer.delivered_cached = timeline.get("cached_prompt_tokens")
        if timeline:
            answer.unstaged = any(event.get("kind") == "unstaged" for event in timeline.get("events", []))
    elif event == "error":
        answer.error = str(data.get("error") or data)


async def offer(
    url: str, questions: Sequence[str], rate: float, seconds: float, *, k: int, max_tokens: int, seed: int
) -> list[Answer]:
    """Questions at Poisson arrivals of ``rate`` a second for ``seconds``; every answer awaited."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=max(1, int(rate * seconds * 1.5))))
    arrivals = arrivals[arrivals < seconds]
    answers: list[Answer] = []
    tasks: list[asyncio.Task[None]] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        start = time.perf_counter()
        for number, arrival in enumerate(arrivals):
            delay = start + float(arrival) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = {
                "query": questions[number % len(questions)],
                "k": k,
                "max_tokens": max_tokens,
                "stream": True,
            }
            sent_at = time.perf_counter()
            answer = Answer(sent_at=sent_at, send_late_s=sent_at - start - float(arrival))
            answers.append(answer)
            tasks.append(asyncio.create_task(_ask(session, url, body, answer)))
        await asyncio.gather(*tasks)
    return answers
