"""One engine request of a query, pumped into a queue so its prefill runs while the query searches.

The request runs on one replica, which counts it as pending until its first token (its queue is
what the router estimates waits from) and may fail it at once when the replica is excluded.
:class:`RetriedFlight` streams a request's outputs and, when it fails, resubmits it elsewhere:
from its prompt before the first token, or, once tokens were sent, from its prompt plus those
tokens (a migration), so the caller's stream goes on. The controller's answers and
``bench.scale``'s replays both use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace

from specrag.controller.gate import Slot
from specrag.controller.placement import Placed, Placement
from specrag.errors import EngineError, EngineTimeoutError, EngineUnavailableError
from specrag.pipeline.engines.protocol import EngineOutput, Sampling, latest_cached_tokens, now

__all__ = ["Flight", "Resubmit", "RetriedFlight"]


class Flight:
    """One engine request, pumped into a queue by a task so its prefill runs while we search.

    The slot in the prefill pool is released at the first token, or when the request ends.
    """

    def __init__(
        self, placed: Placed, sampling: Sampling, slot: Slot, speculative: bool, sent: Sequence[int] = ()
    ):
        self.request_id = ("spec-" if speculative else "final-") + uuid.uuid4().hex
        self.replica = replica = placed.replica
        self.layout = layout = placed.layout
        # A migrated answer continues from the tokens another request already sent: the engine
        # sees them as the end of the prompt, and generates only what is left of max_tokens.
        self.prompt_token_ids = (*layout.token_ids, *sent) if sent else layout.token_ids
        # The knowledge tree's estimate of the engine's prefix hit at submission, set by the run
        # that launched it, to be checked against the engine's answer (``cached_tokens``).
        self.predicted_cached_tokens = 0
        # What else of ours was in the engine when this one was submitted (prefills, a warm-up, a
        # speculation, decodes): the engine shares its steps with them, and a prefill running
        # beside may grow the cache before this one is scheduled, so the prediction lags behind.
        self.load_at_submit = replica.engine.load()
        self.others_prefilling = self.load_at_submit.prefilling > 0
        # Told at the first token, when the prompt's blocks are in the engine's cache; set by the
        # run right after construction (the pump starts at the run's next await).
        self.on_prefilled: Callable[[Flight], None] | None = None
        self.sampling = sampling
        self.submitted_at = now()
        self.first_token_at: float | None = None
        # The engine's stamps of the first token's way, when it reports them (EngineOutput).
        self.queued_at: float | None = None
        self.scheduled_at: float | None = None  # when the engine began its prefill
        self.engine_first_token_at: float | None = None  # when the engine produced the first token
        self.cached_tokens: int | None = None
        self._slot = slot
        self._outputs: asyncio.Queue[EngineOutput | BaseException | None] = asyncio.Queue()
        replica.submitted(self.request_id, placed.predicted_cached, len(self.prompt_token_ids), self._fail)
        left = replace(sampling, max_tokens=sampling.max_tokens - len(sent)) if sent else sampling
        self._task = asyncio.create_task(self._pump(left), name=self.request_id)

    async def _pump(self, sampling: Sampling) -> None:
        try:
            engine = self.replica.engine
            async for output in engine.generate(self.request_id, self.prompt_token_ids, sampling):
                self.cached_tokens = latest_cached_tokens(output, self.cached_tokens)
                if self.first_token_at is None:
                    self.first_token_at = output.received_at
                    self.queued_at = output.queued_at
                    self.scheduled_at = output.scheduled_at
                    self.engine_first_token_at = output.emitted_at
                    self.replica.first_token(self.request_id, output.received_at)
                    if self.on_prefilled is not None:  # before the slot wakes a queued request
                        self.on_prefilled(self)
                    self._slot.release()
                self._outputs.put_nowait(output)
            self._outputs.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # handed to the consumer, who raises it in its own context
            self._outputs.put_nowait(error)
        finally:
            self.replica.finished(self.request_id)
            self._slot.release()

    def adopt(self) -> None:
        """This speculation is its query's answer: its slot is final work from now on."""
        self._slot.adopt()

    def _fail(self, error: EngineError) -> None:
        """The replica was excluded: end the request with ``error`` now.

        The pump stops; the consumer raises the error (after the outputs already queued) and
        may retry on another replica, or migrate the answer there.
        """
        self._task.cancel()
        self._outputs.put_nowait(error)

    def prefill_sample(self) -> tuple[int, int, float] | None:
        """(cached tokens, computed tokens, prefill seconds) once the engine told its hit, else None.

        The prefill runs from when the engine scheduled the request (submission when it does not
        say) to the first token, so time spent queued behind other requests is not counted.
        """
        if self.first_token_at is None or self.cached_tokens is None:
            return None
        started = self.scheduled_at if self.scheduled_at is not None else self.submitted_at
        computed = len(self.prompt_token_ids) - self.cached_tokens
        return self.cached_tokens, computed, max(0.0, self.first_token_at - started)

    async def outputs(
        self, first_token_timeout_s: float, inter_token_timeout_s: float
    ) -> AsyncIterator[EngineOutput]:
        """The request's outputs: the first within ``first_token_timeout_s``, each later one within
        ``inter_token_timeout_s`` of asking for it. Past either, the engine request is aborted and
        :class:`EngineTimeoutError` raised: a stream that stalls is a failed one, whichever engine
        runs it (an in-process engine has no clock of its own between tokens), so the caller
        moves it elsewhere like one whose engine died. Only the wait for the engine counts: outputs
        already queued (a slow reader) are no stall."""
        first, queue = True, self._outputs
        while True:
            try:
                if queue.empty():  # a deadline on the wait only (no task made for it, as wait_for does)
                    async with asyncio.timeout(first_token_timeout_s if first else inter_token_timeout_s):
                        item = await queue.get()
                else:
                    item = queue.get_nowait()
            except TimeoutError:
                await self.abort()
                if first:
                    raise EngineTimeoutError(f"no first token within {first_token_timeout_s:.1f} s") from None
                raise EngineTimeoutError(
                    f"the answer stalled: no token for {inter_token_timeout_s:.1f} s"
                ) from None
            first = False
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def abort(self) -> None:
        """Stop the request in the engine (effective after its current step) and the pump.

        The slot is given back even when the engine's abort fails: the request is gone from our
        side either way, and a slot held forever would shrink the prefill pool for good.
        """
        try:
            if not self._task.done():
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            await self.replica.engine.abort(self.request_id)
        finally:
            self.replica.finished(self.request_id)
            self._slot.release()


Resubmit = Callable[[Placed, "Flight", EngineError, tuple[int, ...]], Awaitable["Flight"]]
"""Submits the placed prompt again after the given flight failed with the error, continuing from
the tokens already sent (none before the first token); returns the new flight."""


class RetriedFlight:
    """A request's outputs as one stream, however many replicas it takes to produce them.

    RAGCache §6: a failure before the first token loses nothing the caller has seen, so the
    prompt is placed again, avoiding the replica that failed (which the placement excludes when
    there are others), or, with one replica, after its supervisor has recovered it, bounded in
    time. A failure after it *migrates* the answer (as NVIDIA Dynamo does): the prompt plus the
    tokens already sent go to another replica, which generates what is left of ``max_tokens``;
    the caller sees one uninterrupted stream. A stop string is the new request's too, and one
    that spans the move (begun in the text already sent) is found here. At most one retry or
    migration per other replica (one with a single replica). The placement hears of every
    failure: a missing first token, or a stream that stalls after it (no token for
    ``inter_token_timeout_s``), is one an engine's supervisor cannot see by itself.
    ``resubmit`` launches the new request (through the caller's gate and bookkeeping);
    :attr:`flight` is always the latest request, the one that answered once the stream ends.
    """

    def __init__(
        self,
        flight: Flight,
        placement: Placement,
        first_token_timeout_s: float,
        resubmit: Resubmit,
        *,
        inter_token_timeout_s: float,
    ) -> None:
        self.flight = flight
        self._placement = placement
        self._timeout_s = first_token_timeout_s
        self._inter_token_timeout_s = inter_token_timeout_s
        self._resubmit = resubmit

    async def outputs(self) -> AsyncIterator[EngineOutput]:
        placement, timeout_s = self._placement, self._timeout_s
        max_tokens, stops = self.flight.sampling.max_tokens, self.flight.sampling.stop
        retries_left = max(1, len(placement.replicas) - 1)
        sent: list[int] = []
        text = ""  # the answer's text so far: where a stop string may begin before a move
        moved_at = 0  # its length at the last move
        while True:
            flight = self.flight
            try:
                async for output in flight.outputs(timeout_s, self._inter_token_timeout_s):
                    if (
                        moved_at
                        and stops
                        and (cut := _spanning_stop(text, moved_at, output.text, stops)) is not None
                    ):
                        yield _finished(output, output.text[:cut], "stop")
                        return
                    sent.extend(output.token_ids)
                    text += output.text
                    yield output
                return
            except EngineError as error:
                restarts = _restarts(flight)
                placement.report_failure(flight.replica, str(error))
                if not retries_left:
                    raise
                retries_left -= 1
                if len(sent) >= max_tokens:  # every token was sent, only the end was lost
                    yield _finished(None, "", "length", flight)
                    return
                if not await placement.wait_ready(timeout_s):
                    if isinstance(error, EngineUnavailableError):
                        raise
                    raise EngineUnavailableError(
                        f"no engine in service after: {error}; retry shortly"
                    ) from error
                placed = placement.place_prompt(flight.layout, avoid=(flight.replica,))
                if isinstance(error, EngineTimeoutError) and not sent and placed.replica is flight.replica:
                    _check_worth_waiting_again(flight, restarts, timeout_s)  # a first-token timeout
                moved_at = len(text) if sent else 0
                self.flight = await self._resubmit(placed, flight, error, tuple(sent))


def _restarts(flight: Flight) -> int | None:
    """How often the flight's engine was replaced so far (None: no supervisor replaces it)."""
    supervision = flight.replica.engine.supervision
    return None if supervision is None else supervision.status().restarts


def _check_worth_waiting_again(flight: Flight, restarts: int | None, timeout_s: float) -> None:
    """A request that timed out goes again to the same engine only if that engine was replaced
    meanwhile (it had hung): a working engine that did not finish the prefill in time would take as
    long again, and the caller would wait twice the timeout."""
    if restarts is not None and _restarts(flight) != restarts:
        return
    raise EngineTimeoutError(
        f"no first token within the first-token timeout of {timeout_s:g} s: the engine did not "
        f"finish the prefill of the {len(flight.prompt_token_ids)}-token prompt in time; a smaller k "
        "or a shorter question prefills faster"
    )


def _spanning_stop(text: str, moved_at: int, new: str, stops: Sequence[str]) -> int | None:
    """Where ``new`` must be cut (0 when the stop string's start was sent already) for a stop string
    that began in the text sent before the last move and ends in ``new``, or None. One that lies
    after the move is the new request's own, which its engine stops at."""
    start = max(moved_at - max(map(len, stops)) + 1, 0)
    tail = text[start:]
    joined = tail + new
    cuts = []
    for stop in stops:
        index = joined.find(stop)
        if index != -1 and start + index < moved_at and index + len(stop) > len(tail):
            cuts.append(max(index - len(tail), 0))
    return min(cuts) if cuts else None


def _finished(
    output: EngineOutput | None, text: str, reason: str, flight: Flight | None = None
) -> EngineOutput:
    """The last output of a migrated answer that the engine could not give: ``output`` cut to
    ``text``, or an empty one of ``flight``'s."""
    if output is not None:
        return replace(output, token_ids=(), text=text, finished=True, finish_reason=reason)
    assert flight is not None
    return EngineOutput(
        flight.request_id, (), "", len(flight.prompt_token_ids), flight.cached_tokens, True, reason, now()
    )
