"""The RAG controller: what every query shares, and one :class:`~specrag.controller.run.QueryRun`
per query.

The controller holds the engine replicas (one, or several behind a router: see
:mod:`specrag.controller.placement`), each with the knowledge tree mirroring its cache, the vector
index, the prompt builder, the prefill gate, the sessions and the system-prompt warmer; it checks
each request once and hands it to a new run, which does the query's work (staged search
overlapped with speculative prefill, cache-aware prompts, adoption; see
:mod:`specrag.controller.run`). What is in flight is read from
the live runs, never kept beside them. Front ends use it through
:class:`~specrag.controller.facade.QueryCore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence

from specrag.cache.hints import HintConfig
from specrag.cache.prefill_estimator import PrefillEstimator
from specrag.controller.batch import BatchAnswers, run_batch
from specrag.controller.config import FALLBACK_BATCHED_TOKEN_BUDGET, ControllerConfig, PrefillOrder
from specrag.controller.conversation import TurnPrompts
from specrag.controller.facade import CoreLoad, EngineHealth, ReplicaFacts
from specrag.controller.gate import OrderingWindow, PrefillGate, default_max_prefill_bs
from specrag.controller.modes import DocumentKv, DocumentKvVariant, get_mode
from specrag.controller.placement import Placement
from specrag.controller.query import AnswerDelta, AnswerDone, CheckedRequest, RagRequest
from specrag.controller.query_shared import QueryShared
from specrag.controller.run import QueryRun
from specrag.controller.sampling import check_sampling
from specrag.controller.sessions import Session, SessionStore
from specrag.controller.speculation_policy import SpeculationPolicy
from specrag.controller.warmup import SystemPromptWarmer, WarmupRecord
from specrag.errors import EngineError, InvalidInputError, TooLargeError, check_choice, echo
from specrag.pipeline.engines.base import check_penalties
from specrag.pipeline.engines.protocol import Engine, Sampling
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.vector_index import VectorIndex

__all__ = [
    "AnswerDelta",
    "AnswerDone",
    "CheckedRequest",
    "ControllerConfig",
    "RagController",
    "RagRequest",
    "step_token_budget",
]

logger = logging.getLogger(__name__)

# Typical prompt for the default max_prefill_bs: k passages of ~250 tokens plus the instructions.
_EXPECTED_PASSAGE_TOKENS = 250
# How long /health waits for one replica's counts: an engine that is being restarted (a Ray actor
# killed and brought back) may not answer at all, and a health check must answer regardless.
HEALTH_PROBE_TIMEOUT_S = 5.0


def step_token_budget(config: ControllerConfig, engine: Engine) -> int:
    """Prompt tokens the engine computes per step: configured, else the engine's own, else vLLM's
    CPU default (logged, since the prefill pool is then sized on an assumption)."""
    if config.batched_token_budget is not None:
        return config.batched_token_budget
    reported = engine.batched_token_budget
    if reported is not None:
        return reported
    logger.warning(
        "the engine reports no per-step token budget: assuming %d (set batched_token_budget)",
        FALLBACK_BATCHED_TOKEN_BUDGET,
    )
    return FALLBACK_BATCHED_TOKEN_BUDGET


class RagController:
    """Answers questions with staged retrieval, speculative prefill and cache-aware ordering.

    ``placement`` holds the engine replicas, each with its own tree: one engine is a pool of one
    (:meth:`Placement.of_one`). The prefill gate grows with the replicas: each engine's steps hold
    ``max_prefill_bs`` prompts.
    """

    def __init__(
        self,
        placement: Placement,
        index: VectorIndex,
        builder: PromptBuilder,
        config: ControllerConfig | None = None,
    ) -> None:
        self.config = config or ControllerConfig()  # checked when it was made
        self.placement = placement
        # Every replica runs the same model on the same kind of engine: the first speaks for all.
        first = placement.replicas[0]
        self.index = index
        self.builder = builder
        self.batched_token_budget = step_token_budget(self.config, first.engine)
        # PGDSF costs follow the engine in use: fitted from served answers, the tree's until then.
        self.prefill_estimator = PrefillEstimator(first.tree.profile)
        # Prices each speculative prefill from the profile above, the index's stage figures and the
        # engine's step (a stale speculation holds the next one up for the step in progress).
        self.speculation = SpeculationPolicy(
            self.config.speculation, self.prefill_estimator, self.batched_token_budget
        )
        max_bs = self.config.max_prefill_bs or default_max_prefill_bs(
            self.batched_token_budget,
            len(builder.system_token_ids) + self.config.k_default * _EXPECTED_PASSAGE_TOKENS,
        )
        replicas = len(self.placement.replicas)
        window = None
        if self.config.prefill_order is PrefillOrder.WINDOW:
            if replicas > 1:
                raise InvalidInputError(
                    "the window prefill order plans against one engine's tree: use one replica"
                )
            window = OrderingWindow(first.tree, self.config.window_requests)
        self.gate = PrefillGate(
            max_bs * replicas,
            self.config.starvation_window_s,
            self.config.speculative_token_budget or self.batched_token_budget * replicas,
            window,
            max_wait_s=self.config.first_token_timeout_s,
        )
        self.sessions = SessionStore(
            self.config.max_sessions, self.config.session_ttl_s, self.config.max_sessions_per_client
        )
        self._hints = HintConfig(order_hint=self.config.order_hint)
        self._turn_prompts = TurnPrompts(builder, self._hints)
        self._warmer = SystemPromptWarmer(
            self.placement.replicas, builder, self.gate, self.config.first_token_timeout_s
        )
        self._runs: set[QueryRun] = set()

    # ------------------------------------------------------------------ queries

    @property
    def default_mode(self) -> str:
        return self.config.mode

    @property
    def warmups(self) -> WarmupRecord:
        """The system-prompt warm-ups this controller ran (shared work, in no query's timeline)."""
        return self._warmer.record

    def in_flight_request_ids(self) -> set[str]:
        """Engine requests the live queries hold and have not yet aborted (for leak checks)."""
        return {request_id for run in self._runs for request_id in run.request_ids()}

    def check(self, request: RagRequest) -> CheckedRequest:
        """The request checked, or :class:`InvalidInputError`/:class:`NotFoundError`.

        Cheap and public so that a server can check a request before admitting it: under load,
        malformed input should still get its 4xx, not a 429 for a slot it never needed. The
        result goes to :meth:`stream` or :meth:`answer`, which then do not check it again.
        """
        if not isinstance(request.question, str) or not request.question.strip():
            raise InvalidInputError("the question is empty")
        try:
            request.question.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (JSON allows "\ud800"); tokenizers reject it
            raise InvalidInputError("the question is not valid Unicode text") from None
        k = self.config.check_k(self.config.k_default if request.k is None else request.k)
        mode = get_mode(self.config.mode if request.mode is None else request.mode)
        max_tokens = self.config.max_tokens_default if request.max_tokens is None else request.max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise InvalidInputError(f"max_tokens must be an integer, got {echo(max_tokens)}")
        if not 1 <= max_tokens <= self.config.max_tokens_limit:
            raise InvalidInputError(f"max_tokens must be between 1 and {self.config.max_tokens_limit}")
        sampling = self._sampling(request, max_tokens)
        session = (
            self.sessions.get(request.session_id, request.client) if request.session_id is not None else None
        )
        if session is not None:  # told before it is let in; stream() claims the session
            self.sessions.ensure_idle(session)
        # Rejects over-long questions before any work; the tokens serve every prompt of the query.
        question_token_ids = tuple(self.builder.question_tokens(request.question))
        document_kv = self._document_kv(request, session)
        fresh = self._document_kv_fresh(request, k)
        speculation = self.speculation.for_query(mode.speculation)
        return CheckedRequest(
            request,
            k,
            mode,
            sampling,
            session,
            question_token_ids,
            speculation,
            document_kv=document_kv,
            document_kv_fresh=fresh if document_kv else 0,
            document_kv_after_system=self.config.document_kv_variant is DocumentKvVariant.AFTER_SYSTEM,
        )

    def _sampling(self, request: RagRequest, max_tokens: int) -> Sampling:
        """The request's decoding: the configured repetition control where every replica's engine
        applies penalties (a simulated one cannot); a penalty the request itself sets on an engine
        that cannot apply it is refused by name."""
        honoured = all(getattr(r.engine, "honours_penalties", False) for r in self.placement.replicas)
        sampling = check_sampling(request, max_tokens, self.config.default_penalties if honoured else {})
        check_penalties(sampling, honoured)
        return sampling

    def _document_kv(self, request: RagRequest, session: Session | None) -> bool:
        """Whether the request loads its documents' KV from the store (``turbo``).

        A conversation's later turns prefill as they always do: their history is no document.
        """
        choice = self.config.document_kv if request.document_kv is None else request.document_kv
        if check_choice("document_kv", choice, DocumentKv) is not DocumentKv.TURBO or session is not None:
            return False
        if not all(getattr(r.engine, "supports_document_kv", False) for r in self.placement.replicas):
            raise InvalidInputError("document_kv 'turbo' needs engines started with --document-kv turbo")
        return True

    def _document_kv_fresh(self, request: RagRequest, k: int) -> int:
        """The request's top documents prefilled fresh (tiers): its own, from 0 to its ``k``, or the
        controller's capped at ``k``."""
        if request.document_kv_fresh is None:
            return min(self.config.document_kv_fresh, k)
        return self.config.check_fresh(request.document_kv_fresh, k)

    async def answer(self, request: RagRequest | CheckedRequest) -> AnswerDone:
        """Run a query to the end and return the whole answer."""
        async with contextlib.aclosing(self.stream(request)) as events:
            async for event in events:
                if isinstance(event, AnswerDone):
                    return event
        raise EngineError("the answer stream ended without a result")

    def check_batch(self, requests: Sequence[object]) -> list[CheckedRequest]:
        """A batch's requests checked (see :meth:`check`), each error naming its question.

        At most ``max_batch_queries`` (more: :class:`TooLargeError`); a batch query cannot belong
        to a session (a conversation's turns run one after the other).
        """
        limit = self.config.max_batch_queries
        if not requests:
            raise InvalidInputError("a batch needs at least one question")
        if len(requests) > limit:
            raise TooLargeError(f"a batch takes at most {limit} questions, got {len(requests)}")
        checked = []
        for number, request in enumerate(requests):
            try:
                if not isinstance(request, RagRequest):
                    raise InvalidInputError(f"expected a RagRequest, got {type(request).__name__}")
                if request.session_id is not None:
                    raise InvalidInputError("a batch query cannot continue a session")
                checked.append(self.check(request))
            except InvalidInputError as error:
                raise InvalidInputError(f"queries[{number}]: {error}") from None
        return checked

    async def answer_batch(self, requests: Sequence[RagRequest] | Sequence[CheckedRequest]) -> BatchAnswers:
        """Answer questions known together in the order that shares the most prompt prefix
        (:mod:`specrag.controller.batch`); the answers come back in the order asked.

        Plain requests are checked here (:meth:`check_batch`); checked ones are used as they are.
        """
        checked = [r for r in requests if isinstance(r, CheckedRequest)]
        if not checked or len(checked) != len(requests):
            checked = self.check_batch(requests)
        return await run_batch(self.index, checked, self.stream)

    async def stream(
        self, request: RagRequest | CheckedRequest
    ) -> AsyncGenerator[AnswerDelta | AnswerDone, None]:
        """Answer deltas, then :class:`AnswerDone`. Closing the iterator early aborts every request.

        A plain :class:`RagRequest` is checked here; a :class:`CheckedRequest` is used as it is.
        A session runs one turn at a time: a second one gets :class:`ConflictError`.
        """
        checked = request if isinstance(request, CheckedRequest) else self.check(request)
        session = checked.session
        if session is not None:
            self.sessions.begin_turn(session)
        run = QueryRun(self._shared(), checked)
        self._runs.add(run)
        try:
            async with contextlib.aclosing(run.events()) as events:
                async for event in events:
                    yield event
        finally:
            await run.abort_all()
            self._runs.discard(run)
            if session is not None:
                self.sessions.end_turn(session)

    def _shared(self) -> QueryShared:
        """What a new run shares with the others (read now: a test may swap the index between queries)."""
        return QueryShared(
            self.config,
            self.placement,
            self.index,
            self.builder,
            self.prefill_estimator,
            self.gate,
            self.sessions,
            self._warmer,
            self._hints,
            self._turn_prompts,
        )

    # ------------------------------------------------------------------ the rest of the facade

    def load(self) -> CoreLoad:
        return CoreLoad(prefill_pool=self.gate.pool, queued=self.gate.waiting)

    async def health(self) -> EngineHealth:
        """Whether an engine answers (its own counts), with the first's supervisor status if it has
        one, and every replica's facts.

        With several replicas the service serves while any replica does: one replica down (or
        restarting) is routed around, not a reason to turn callers away.
        """
        supervision = self.placement.replicas[0].engine.supervision
        status = supervision.status() if supervision is not None else None
        facts = tuple(
            ReplicaFacts(
                r.name, r.available, r.excluded, r.pending, round(r.speed, 3), r.tree.profile.measured
            )
            for r in self.placement.replicas
        )
        reasons = []
        for replica in self.placement.replicas:
            try:
                if replica.excluded is not None:
                    raise EngineError(f"excluded: {replica.excluded}")
                await asyncio.wait_for(replica.engine.counts(), HEALTH_PROBE_TIMEOUT_S)
            except (EngineError, TimeoutError) as error:
                reason = str(error) or f"did not answer within {HEALTH_PROBE_TIMEOUT_S:g} s"
                alone = len(self.placement.replicas) == 1
                reasons.append(reason if alone else f"{replica.name}: {reason}")
                continue
            return EngineHealth(serving=True, reason=None, supervision=status, replicas=facts)
        return EngineHealth(serving=False, reason="; ".join(reasons), supervision=status, replicas=facts)

    def create_session(self, client: str) -> str:
        return self.sessions.create(client).session_id

    def close_session(self, session_id: str, client: str) -> None:
        self.sessions.close(session_id, client)

    # ------------------------------------------------------------------ lifecycle

    async def reset_prefix_cache(self) -> None:
        """Empty every engine's prefix cache and tell its tree at once (for cold-start experiments).

        vLLM publishes the AllBlocksCleared event only with its next step; the tree must not
        believe in cached blocks until then.
        """
        for replica in self.placement.replicas:
            await replica.engine.reset_prefix_cache()
            replica.tree.engine_cache_cleared()

    async def close(self) -> None:
        """Abort every request the live queries hold and any warm-up (service shutdown)."""
        for run in list(self._runs):
            await run.abort_all()
        await self._warmer.close()
