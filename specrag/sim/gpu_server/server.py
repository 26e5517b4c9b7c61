"""The stand-in's HTTP face: what :class:`~specrag.pipeline.engines.http_engine.HttpEngine` uses of
vLLM's OpenAI server, on 127.0.0.1 only.

- ``POST /v1/completions`` with a token-ID prompt and ``stream: true``: server-sent chunks with
  vLLM's ``token_ids`` extension, the finishing chunk, then (with ``stream_options.include_usage``)
  the usage chunk carrying ``prompt_tokens_details.cached_tokens``, then ``[DONE]``; ``X-Request-Id``
  names the request. A text prompt, a missing or bad ``max_tokens`` or a prompt too long is a 400
  in vLLM's error shape. Closing the connection aborts the request.
- ``GET /v1/models`` (with ``max_model_len``), ``GET /health``, ``GET /metrics`` (vLLM's running
  and waiting gauges, ``vllm:cache_config_info`` with the block size and count, the prefix-cache
  query and hit counters), ``POST /reset_prefix_cache`` (``{"success": false}`` while blocks are held).
- ``GET /standin/requests``: each finished request's modelled time to first token and the loop's
  lateness, for a benchmark that subtracts the engine's own time; ``?clear=1`` forgets them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web
from vllm.distributed.kv_events import ZmqEventPublisher

from specrag.errors import InvalidInputError
from specrag.sim.gpu_server.engine import FINISHED, Request, StepEngine
from specrag.sim.gpu_server.prefix_cache import HASH_ALGORITHM, PrefixCache
from specrag.sim.gpu_server.time_model import TimeModel

__all__ = ["HOST", "StandInServer", "StandInSettings"]

HOST = "127.0.0.1"

_ENGINE: web.AppKey[StepEngine] = web.AppKey("engine", StepEngine)
_SETTINGS: web.AppKey[StandInSettings] = web.AppKey("settings")


@dataclass(frozen=True)
class StandInSettings:
    """One replica: its ports, the model name it answers to, its cache and its time model."""

    port: int
    kv_events_port: int
    model: str = "gpu-stand-in-8b"
    max_model_len: int = 8192
    block_size: int = 16
    num_blocks: int = 25_000
    time_model: TimeModel = field(default_factory=TimeModel)

    def __post_init__(self) -> None:
        for name, port in (("port", self.port), ("kv events port", self.kv_events_port)):
            if not 1 <= port <= 65534:
                raise InvalidInputError(f"stand-in: the {name} must be between 1 and 65534, got {port}")
        if self.max_model_len < 2:
            raise InvalidInputError(f"stand-in: max_model_len must be at least 2, got {self.max_model_len}")


def _publisher_endpoint(port: int) -> str:
    """vLLM's publisher binds only an endpoint with ``*`` or ``::`` (else it connects): loopback
    is written IPv4-mapped, as ``specrag engine`` writes it."""
    return f"tcp://[::ffff:{HOST}]:{port}"


class StandInServer:
    """The stand-in serving on ``settings.port`` and publishing on ``kv_events_port`` (replays on
    the next port) while the block runs; stopped, sockets closed, on exit."""

    def __init__(self, settings: StandInSettings) -> None:
        self.settings = settings
        self._runner: web.AppRunner | None = None
        self._publisher: ZmqEventPublisher | None = None
        self.engine: StepEngine | None = None

    async def __aenter__(self) -> StandInServer:
        settings = self.settings
        self._publisher = ZmqEventPublisher(
            0,
            endpoint=_publisher_endpoint(settings.kv_events_port),
            replay_endpoint=_publisher_endpoint(settings.kv_events_port + 1),
            topic="kv",
        )
        cache = PrefixCache(settings.num_blocks, settings.block_size)
        self.engine = StepEngine(cache, settings.time_model, self._publisher.publish)
        self.engine.start()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app[_ENGINE], app[_SETTINGS] = self.engine, settings
        app.router.add_post("/v1/completions", _completions)
        app.router.add_get("/v1/models", _models)
        app.router.add_get("/health", _health)
        app.router.add_get("/metrics", _metrics)
        app.router.add_post("/reset_prefix_cache", _reset)
        app.router.add_get("/standin/requests", _records)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, HOST, settings.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.engine is not None:
            await self.engine.stop()
        if self._publisher is not None:
            await asyncio.to_thread(self._publisher.shutdown)


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "BadRequestError", "code": status}}, status=status
    )


def _request_of(body: Any, settings: StandInSettings, request_id: str) -> Request:
    if not isinstance(body, dict):
        raise InvalidInputError("the body must be a JSON object")
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
        raise InvalidInputError("this stand-in takes a prompt of token ids only (a non-empty list of ints)")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidInputError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if len(prompt) + max_tokens > settings.max_model_len:
        raise InvalidInputError(
            f"this model's maximum context length is {settings.max_model_len} tokens; the prompt "
            f"({len(prompt)}) and max_tokens ({max_tokens}) ask for {len(prompt) + max_tokens}"
        )
    if body.get("stream") is not True:
        raise InvalidInputError("this stand-in streams only: send stream: true")
    return Request(request_id, prompt, max_tokens, time.perf_counter())


def _chunk(request: Request, model: str, created: int, choices: list[dict[str, Any]], **extra: Any) -> bytes:
    payload = {
        "id": f"cmpl-{request.request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        **extra,
    }
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _completions(http: web.Request) -> web.StreamResponse:
    arrival = time.perf_counter()
    engine, settings = http.app[_ENGINE], http.app[_SETTINGS]
    request_id = http.headers.get("X-Request-Id") or uuid.uuid4().hex
    try:
        body = await http.json()
        request = _request_of(body, settings, request_id)
        request.arrival = arrival
        engine.submit(request)
    except ValueError as error:  # InvalidInputError and bad JSON alike
        return _error(400, str(error))
    model, created = str(body.get("model") or settings.model), int(time.time())
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await response.prepare(http)
        sent = 0
        while (token := await request.tokens.get()) != FINISHED:
            sent += 1
            reason = "length" if sent == request.max_tokens else None
            choice = {
                "index": 0,
                "text": " x",
                "logprobs": None,
                "finish_reason": reason,
                "token_ids": [token],
            }
            await response.write(_chunk(request, model, created, [choice]))
        if include_usage:
            usage = {
                "prompt_tokens": len(request.prompt),
                "completion_tokens": sent,
                "total_tokens": len(request.prompt) + sent,
                "prompt_tokens_details": {"cached_tokens": request.cached_tokens},
            }
            await response.write(_chunk(request, model, created, [], usage=usage))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    finally:
        engine.abort(request)  # a no-op once it finished; frees its blocks if the client left
    return response


async def _models(http: web.Request) -> web.Response:
    settings = http.app[_SETTINGS]
    entry = {
        "id": settings.model,
        "object": "model",
        "owned_by": "specrag-stand-in",
        "max_model_len": settings.max_model_len,
    }
    return web.json_response({"object": "list", "data": [entry]})


async def _health(http: web.Request) -> web.Response:
    return web.Response(status=200)


async def _metrics(http: web.Request) -> web.Response:
    engine, settings = http.app[_ENGINE], http.app[_SETTINGS]
    label = f'model_name="{settings.model}"'
    cache_labels = (
        f'block_size="{settings.block_size}",num_gpu_blocks="{settings.num_blocks}",'
        f'enable_prefix_caching="True",prefix_caching_hash_algo="{HASH_ALGORITHM}"'
    )
    lines = [
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{label}}} {len(engine.running)}",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{label}}} {len(engine.waiting)}",
        "# TYPE vllm:cache_config_info gauge",
        f"vllm:cache_config_info{{{cache_labels}}} 1.0",
        "# TYPE vllm:prefix_cache_queries counter",
        f"vllm:prefix_cache_queries_total{{{label}}} {engine.cache.queried_tokens}",
        "# TYPE vllm:prefix_cache_hits counter",
        f"vllm:prefix_cache_hits_total{{{label}}} {engine.cache.hit_tokens}",
        "# TYPE specrag_standin_steps counter",
        f"specrag_standin_steps_total {engine.steps}",
        "# TYPE specrag_standin_kv_events counter",
        f"specrag_standin_kv_events_total {engine.published_events}",
    ]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


async def _reset(http: web.Request) -> web.Response:
    return web.json_response({"success": http.app[_ENGINE].reset_prefix_cache()})


async def _records(http: web.Request) -> web.Response:
    engine = http.app[_ENGINE]
    records = [asdict(record) for record in engine.records]
    if http.query.get("clear") == "1":
        engine.records.clear()
    return web.Response(text=json.dumps({"requests": records}), content_type="application/json")
