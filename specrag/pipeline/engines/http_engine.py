"""The engine behind an OpenAI-compatible HTTP server: vLLM's api_server, SGLang, a remote GPU box.

Why over HTTP: scale-out (several servers, one per GPU) and engines that cannot run in our
process. The protocol is the same as the in-process adapter's, with these differences, all
forced by what the server says on the wire:

- **Prompts** go as token IDs (``"prompt": [ids]``) to ``POST /v1/completions`` with
  ``stream: true``; output token IDs come from vLLM's ``return_token_ids`` extension (a server
  without it streams text only, and ``token_ids`` is then empty).
- **Cached tokens** come from ``usage.prompt_tokens_details.cached_tokens``, which vLLM sends
  only when started with ``--enable-prompt-tokens-details`` and only in the final usage chunk
  (vLLM 0.32's ``continuous_usage_stats`` adds token counts to every chunk but never the prompt
  details, so it is not asked for). So here ``cached_tokens`` is None on every increment but the
  last (the finishing output is held back until the usage chunk arrives), which the protocol
  allows (see :class:`~specrag.pipeline.engines.protocol.EngineOutput`); a server that never reports it
  leaves it None throughout, and :meth:`HttpEngine.warm` then reports 0 cached tokens. A request
  aborted before it finishes never learns its count.
- **Abort** closes the request's connection: vLLM aborts a request soon after the disconnect
  (docs/vllm-cpu.md measures how soon). As with ``AsyncLLM`` the stream then ends with an
  empty output whose ``finish_reason`` is ``"abort"``.
- **Block size**: from the ``vllm:cache_config_info`` metric when the server exports it, else
  the constructor argument, else 16 (GPU vLLM's default; CPU vLLM defaults to 128, and specrag
  starts it with 32). ``max_model_len`` comes from ``GET /v1/models`` (vLLM lists it) unless given.
- **counts()** reads the server's Prometheus ``/metrics`` (``vllm:num_requests_running`` /
  ``vllm:num_requests_waiting``, or SGLang's ``sglang:num_running_reqs`` /
  ``sglang:num_queue_reqs``). The server exposes no "unfinished" count; it is running + waiting.
- **reset_prefix_cache()** needs vLLM's ``POST /reset_prefix_cache`` (served only with
  ``VLLM_SERVER_DEV_MODE=1``) or SGLang's ``POST /flush_cache``.

Errors: connection refused, timeouts (connect, first token, between chunks) and HTTP 5xx raise
:class:`EngineError` naming the URL, the status and the server's own message; HTTP 400, 413 and
422 (the server rejected this prompt, e.g. too long) raise :class:`InvalidInputError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from specrag.errors import EngineError, InvalidInputError
from specrag.pipeline.engines.base import DescribedEngine
from specrag.pipeline.engines.protocol import EngineCounts, EngineOutput, EngineShape, Sampling, now

__all__ = ["DEFAULT_BLOCK_SIZE", "HttpEngine", "HttpTimeouts"]

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
"""vLLM's default KV block size on GPUs, used when the server does not publish its own."""

_PROMPT_ERRORS = frozenset({400, 413, 422})
"""Statuses that blame the request itself: retrying the same prompt fails again."""

_RUNNING_METRICS = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING_METRICS = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")


@dataclass(frozen=True)
class HttpTimeouts:
    """Seconds to wait before declaring the server failed.

    ``first_token_s`` runs from sending the request to its first streamed chunk, so it must
    cover a cold prefill of the longest prompt (plus queueing); ``between_chunks_s`` bounds every
    later silence; ``control_s`` bounds ``/v1/models``, ``/metrics`` and cache resets.
    """

    connect_s: float = 5.0
    first_token_s: float = 120.0
    between_chunks_s: float = 30.0
    control_s: float = 10.0

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if value <= 0:
                raise InvalidInputError(f"http engine: timeout {name} must be positive, got {value}")


@dataclass(frozen=True)
class _ServerInfo(EngineShape):
    model: str


_UNDISCOVERED = _ServerInfo(block_size=1, max_model_len=1, kv_capacity_tokens=None, model="")
"""Placeholder until :meth:`HttpEngine.connect` has asked the server."""


class _Aborted(Exception):
    """The request's connection was closed by :meth:`HttpEngine.abort`."""


class HttpEngine(DescribedEngine):
    """:class:`~specrag.pipeline.engines.protocol.Engine` over an OpenAI-compatible server (module doc).

    Build it with :meth:`connect`, which asks the server for its model, length limit and block size.
    """

    _info: _ServerInfo

    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, info: _ServerInfo, timeouts: HttpTimeouts
    ) -> None:
        super().__init__()
        self._session = session
        self._base_url = base_url
        self._info = info
        self._timeouts = timeouts
        self._responses: dict[str, aiohttp.ClientResponse] = {}
        self._aborted: set[str] = set()

    @property
    def honours_penalties(self) -> bool:
        # OpenAI's two penalties are in every compatible server's API, repetition_penalty in
        # vLLM's (the server this adapter is written for); each is sent only when set.
        return True

    @classmethod
    async def connect(
        cls,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        block_size: int | None = None,
        max_model_len: int | None = None,
        timeouts: HttpTimeouts | None = None,
    ) -> HttpEngine:
        """Open one shared session to ``base_url`` (e.g. ``http://127.0.0.1:8000``) and discover
        the served model. ``model`` defaults to the first one ``/v1/models`` lists; explicit
        ``block_size`` / ``max_model_len`` override what the server reports."""
        timeouts = timeouts or HttpTimeouts()
        base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        session = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None, connect=timeouts.connect_s),
        )
        try:
            engine = cls(session, base_url, _UNDISCOVERED, timeouts)
            engine._info = await engine._discover(model, block_size, max_model_len)
        except BaseException:
            await session.close()
            raise
        logger.info(
            "HTTP engine ready: %s model=%s max_model_len=%d block_size=%d",
            base_url,
            engine.model,
            engine.max_model_len,
            engine.block_size,
        )
        return engine

    @property
    def base_url(self) -> str:
        return self._base_url

    @property
    def model(self) -> str:
        return self._info.model

    async def _counts(self) -> EngineCounts:
        families = await self._metrics()
        running = _metric_total(families, _RUNNING_METRICS)
        waiting = _metric_total(families, _WAITING_METRICS)
        if running is None or waiting is None:
            raise EngineError(f"{self._base_url}/metrics reports no running/waiting request counts")
        return EngineCounts(running=running, waiting=waiting, unfinished=running + waiting)

    async def _stream(
        self, request_id: str, prompt: list[int], sampling: Sampling
    ) -> AsyncGenerator[EngineOutput, None]:
        finished = False
        response: aiohttp.ClientResponse | None = None
        try:
            response = await self._post_completion(request_id, prompt, sampling)
            held: EngineOutput | None = None
            async for events in self._event_batches(response, request_id):
                # The events of one read arrived together: their tokens go on as one increment
                # (nothing waits for a later read), so each layer above handles it once.
                arrived: EngineOutput | None = None
                for event in events:
                    cached = _cached_tokens(event)
                    for choice in event.get("choices") or ():
                        output = _output(request_id, len(prompt), choice)
                        if output.finished:
                            held = output  # wait for the usage chunk: it carries the cached tokens
                        else:
                            arrived = output if arrived is None else _joined(arrived, output)
                    if held is not None and cached is not None:
                        held = replace(held, cached_tokens=cached)
                if arrived is not None:
                    yield arrived
            if held is None:
                raise EngineError(f"{self._base_url}: request {request_id} ended without finishing")
            finished = True
            yield held
        except _Aborted:
            finished = True
            yield _output(request_id, len(prompt), {"finish_reason": "abort"})
        finally:
            self._aborted.discard(request_id)
            self._responses.pop(request_id, None)
            if response is not None and not finished:
                # Leaving early (cancel, consumer break, error): the disconnect aborts it server-side.
                response.close()

    async def _abort_request(self, request_id: str) -> None:
        response = self._responses.get(request_id)
        if response is not None:
            self._aborted.add(request_id)
            response.close()

    async def _reset_prefix_cache(self) -> bool:
        for path in ("/reset_prefix_cache", "/flush_cache"):
            async with self._control("POST", path) as response:
                if response.status != 404:
                    await self._raise_for_status(response, f"POST {path}")
                    return await _reset_succeeded(response)
        raise EngineError(
            f"{self._base_url} exposes no prefix-cache reset (start vLLM with VLLM_SERVER_DEV_MODE=1)"
        )

    async def _shut_down(self) -> None:
        for response in list(self._responses.values()):
            response.close()
        await self._session.close()

    # HTTP helpers ----------------------------------------------------------------------------

    async def _discover(
        self, model: str | None, block_size: int | None, max_model_len: int | None
    ) -> _ServerInfo:
        async with self._control("GET", "/v1/models") as response:
            await self._raise_for_status(response, "GET /v1/models")
            listed = (await response.json()).get("data") or []
        entries = {str(entry.get("id")): entry for entry in listed if isinstance(entry, dict)}
        if model is None:
            if not entries:
                raise EngineError(f"{self._base_url}/v1/models lists no model")
            model = next(iter(entries))
        if max_model_len is None:
            max_model_len = entries.get(model, {}).get("max_model_len")
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise EngineError(
                f"{self._base_url} does not report max_model_len for model {model!r}; pass it explicitly"
            )
        cache_info = await self._cache_config()
        server_block = int(cache_info.get("block_size") or 0)
        block_size = block_size or server_block or DEFAULT_BLOCK_SIZE
        blocks = int(cache_info.get("num_gpu_blocks") or 0)
        return _ServerInfo(block_size, max_model_len, blocks * block_size or None, model)

    async def _cache_config(self) -> dict[str, str]:
        """vLLM's cache settings from its ``cache_config_info`` metric labels; {} when absent."""
        try:
            families = await self._metrics()
        except EngineError as error:
            logger.info("no usable /metrics at %s (%s): block size not discovered", self._base_url, error)
            return {}
        for family in families:
            if family.name == "vllm:cache_config_info":
                for sample in family.samples:
                    return dict(sample.labels)
        return {}

    async def _metrics(self) -> list[Any]:
        async with self._control("GET", "/metrics") as response:
            await self._raise_for_status(response, "GET /metrics")
            text = await response.text()
        try:
            return list(text_string_to_metric_families(text))
        except ValueError as error:
            raise EngineError(f"{self._base_url}/metrics is not Prometheus text: {error}") from error

    def _control(self, method: str, path: str) -> Any:
        """A short request with the control timeout; connection errors become EngineError."""
        return _Guarded(
            self._session.request(
                method, self._base_url + path, timeout=aiohttp.ClientTimeout(total=self._timeouts.control_s)
            ),
            f"{method} {self._base_url}{path}",
        )

    async def _post_completion(
        self, request_id: str, prompt: list[int], sampling: Sampling
    ) -> aiohttp.ClientResponse:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.ignore_eos:
            body["ignore_eos"] = True
        for name in sampling.penalties:
            body[name] = getattr(sampling, name)
        url = f"{self._base_url}/v1/completions"
        try:
            async with asyncio.timeout(self._timeouts.first_token_s):
                response = await self._session.post(url, json=body, headers={"X-Request-Id": request_id})
        except TimeoutError as error:
            raise EngineError(
                f"{url}: no response to request {request_id} within {self._timeouts.first_token_s:g} s"
            ) from error
        except aiohttp.ClientError as error:
            raise EngineError(f"{url}: request {request_id} failed: {error}") from error
        self._responses[request_id] = response
        await self._raise_for_status(response, f"request {request_id}")
        return response

    async def _event_batches(
        self, response: aiohttp.ClientResponse, request_id: str
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """The JSON payloads of the server-sent events, until ``[DONE]`` or the end of the body,
        as one list per read: those the server's writes left in the buffer together.

        Lines are split here rather than with ``readline()``: aiohttp caps a line at 128 KiB
        and a chunk may echo a long prompt's token IDs.
        """
        buffer = b""
        limit, phase = self._timeouts.first_token_s, "the first chunk"
        while True:
            try:
                async with asyncio.timeout(limit):
                    data = await response.content.readany()
            except TimeoutError as error:
                raise EngineError(
                    f"{self._base_url}: request {request_id}: nothing for {limit:g} s (waiting for {phase})"
                ) from error
            except aiohttp.ClientError as error:
                if request_id in self._aborted:
                    raise _Aborted from error
                raise EngineError(f"{self._base_url}: request {request_id} stream broke: {error}") from error
            if not data:
                if request_id in self._aborted:
                    raise _Aborted
                return
            limit, phase = self._timeouts.between_chunks_s, "the next chunk"
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            events: list[dict[str, Any]] = []
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    yield events
                    return
                try:
                    event = json.loads(payload)
                except ValueError as error:
                    raise EngineError(
                        f"{self._base_url}: request {request_id} sent bad JSON: {error}"
                    ) from error
                if not isinstance(event, dict) or "error" in event:
                    raise EngineError(f"{self._base_url}: request {request_id} failed: {_message(event)}")
                events.append(event)
            if events:
                yield events

    async def _raise_for_status(self, response: aiohttp.ClientResponse, what: str) -> None:
        if response.status < 400:
            return
        try:
            async with asyncio.timeout(self._timeouts.control_s):
                text = await response.text()
        except (TimeoutError, aiohttp.ClientError):
            text = ""
        try:
            message = _message(json.loads(text))
        except ValueError:
            message = text.strip()[:500]
        detail = f"{self._base_url}: {what}: HTTP {response.status}: {message or response.reason}"
        response.close()
        if response.status in _PROMPT_ERRORS:
            raise InvalidInputError(detail)
        raise EngineError(detail)


class _Guarded:
    """An ``async with`` around an aiohttp request that turns transport failures into EngineError."""

    def __init__(self, request: Any, what: str) -> None:
        self._request = request
        self._what = what

    async def __aenter__(self) -> aiohttp.ClientResponse:
        try:
            response: aiohttp.ClientResponse = await self._request.__aenter__()
        except TimeoutError as error:
            raise EngineError(f"{self._what}: timed out") from error
        except aiohttp.ClientError as error:
            raise EngineError(f"{self._what} failed: {error}") from error
        return response

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: object
    ) -> None:
        await self._request.__aexit__(exc_type, exc, traceback)
        if isinstance(exc, TimeoutError):
            raise EngineError(f"{self._what}: timed out") from exc
        if isinstance(exc, aiohttp.ClientError):
            raise EngineError(f"{self._what} failed: {exc}") from exc


def _output(request_id: str, prompt_tokens: int, choice: dict[str, Any]) -> EngineOutput:
    finish_reason = choice.get("finish_reason")
    return EngineOutput(
        request_id=request_id,
        token_ids=tuple(int(token) for token in choice.get("token_ids") or ()),
        text=str(choice.get("text") or ""),
        prompt_tokens=prompt_tokens,
        cached_tokens=None,
        finished=finish_reason is not None,
        finish_reason=finish_reason,
        received_at=now(),
    )


def _joined(first: EngineOutput, then: EngineOutput) -> EngineOutput:
    """Two unfinished increments of one request as one, stamped when the first arrived."""
    return replace(first, token_ids=first.token_ids + then.token_ids, text=first.text + then.text)


def _cached_tokens(event: dict[str, Any]) -> int | None:
    usage = event.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return int(cached) if cached is not None else None


def _message(body: object) -> str:
    """The server's own error message from vLLM's / OpenAI's ``{"error": {"message": ...}}`` shapes."""
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            return str(error.get("message") or error)
        return str(error)
    return str(body)


def _metric_total(families: Sequence[Any], names: Sequence[str]) -> int | None:
    """Sum of a gauge's samples (one per engine / label set), for the first name present."""
    for name in names:
        samples = [sample.value for family in families if family.name == name for sample in family.samples]
        if samples:
            return int(sum(samples))
    return None


async def _reset_succeeded(response: aiohttp.ClientResponse) -> bool:
    """vLLM answers ``{"success": false}`` while blocks are in use; a server that says nothing
    (SGLang's ``/flush_cache``, older vLLM) is taken at its 200."""
    with contextlib.suppress(aiohttp.ContentTypeError, ValueError):
        body = await response.json()
        if isinstance(body, dict) and "success" in body:
            return bool(body["success"])
    return True
