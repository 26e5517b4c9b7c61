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

import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence

from specrag.cache.hints import HintConfig
from specrag.cache.prefill_estimator import PrefillEstimator
from specrag.cache.tree import KnowledgeTree
from specrag.controller.config import FALLBACK_BATCHED_TOKEN_BUDGET, ControllerConfig
from specrag.controller.conversation import TurnPrompts
from specrag.controller.facade import CoreLoad, EngineHealth
from specrag.controller.gate import PrefillGate, WindowAdmission, default_max_prefill_bs
from specrag.controller.modes import get_mode
from specrag.controller.placement import Placement
from specrag.controller.query import AnswerDelta, AnswerDone, CheckedRequest, RagRequest
from specrag.controller.replicas import Replica
from specrag.controller.run import QueryRun, QueryShared
from specrag.controller.sampling import check_sampling
from specrag.controller.sessions import SessionStore
from specrag.controller.speculation_policy import SpeculationPolicy
from specrag.controller.warmup import SystemPromptWarmer, WarmupRecord
from specrag.errors import EngineError, InvalidInputError, echo
from specrag.pipeline.engine import Engine
from specrag.pipeline.prompt import PromptBuilder
from specrag.retrieval.vector_index import VectorIndex

__all__ = [
    "AnswerDelta",
    "AnswerDone",
    "CheckedRequest",
    "ControllerConfig",
    "RagController",
    "RagRequest",
]

logger = logging.getLogger(__name__)

# Typical prompt for the default max_prefill_bs: k passages of ~250 tokens plus the instructions.
_EXPECTED_PASSAGE_TOKENS = 250


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

    ``engine`` is one engine (its tree is ``tree``, or a new one) or a :class:`Placement` over
    several replicas, each with its own tree. The prefill gate grows with the replicas: each
    engine's steps hold ``max_prefill_bs`` prompts.
    """

    def __init__(
        self,
        engine: Engine | Placement,
        index: VectorIndex,
        builder: PromptBuilder,
        config: ControllerConfig | None = None,
        tree: KnowledgeTree | None = None,
    ) -> None:
        self.config = (config or ControllerConfig()).validate()
        if isinstance(engine, Placement):
            if tree is not None:
                raise InvalidInputError("replicas bring their own trees: pass no tree with a placement")
            self.placement = engine
        else:
            # ``is None``, not ``or``: an empty tree has length 0 and is falsy.
            # The system prompt as it starts every prompt, padded to whole blocks: the engine caches
            # (and the tree must predict) its padding block too.
            tree = tree if tree is not None else new_tree(engine, builder.system_layout_tokens())
            self.placement = Placement([Replica("0", engine, tree)])
        self.index = index
        self.builder = builder
        self.batched_token_budget = step_token_budget(self.config, self.engine)
        # PGDSF costs follow the engine in use: fitted from served answers, the tree's until then.
        self.prefill_estimator = PrefillEstimator(self.tree.profile)
        # Prices each speculative prefill from the profile above and the index's stage figures.
        self.speculation = SpeculationPolicy(self.config.speculation, self.prefill_estimator)
        max_bs = self.config.max_prefill_bs or default_max_prefill_bs(
            self.batched_token_budget,
            len(builder.system_token_ids) + self.config.k_default * _EXPECTED_PASSAGE_TOKENS,
        )
        replicas = len(self.placement.replicas)
        window = None
        if self.config.admission == "window":
            if replicas > 1:
                raise InvalidInputError("window admission orders against one engine's tree: use one replica")
            window = WindowAdmission(self.tree, self.config.window_requests)
        self.gate = PrefillGate(
            max_bs * replicas,
            self.config.starvation_window_s,
            self.config.speculative_token_budget or self.batched_token_budget * replicas,
            window,
        )
        self.sessions = SessionStore(
            self.config.max_sessions, self.config.session_ttl_s, self.config.max_sessions_per_client
        )
        self._hints = HintConfig(order_hint=self.config.order_hint)
        self._turn_prompts = TurnPrompts(builder, self._hints)
        self._warmer = SystemPromptWarmer(self.placement.replicas, builder, self.gate)
        self._runs: set[QueryRun] = set()

    @property
    def engine(self) -> Engine:
        """The first replica's engine: the only one without scale-out."""
        return self.placement.replicas[0].engine

    @property
    def tree(self) -> KnowledgeTree:
        """The first replica's knowledge tree: the only one without scale-out."""
        return self.placement.replicas[0].tree

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
        k = self.config.k_default if request.k is None else request.k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.config.k_max:
            raise InvalidInputError(f"k must be an integer between 1 and {self.config.k_max}, got {echo(k)}")
        mode = get_mode(self.config.mode if request.mode is None else request.mode)
        max_tokens = self.config.max_tokens_default if request.max_tokens is None else request.max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise InvalidInputError(f"max_tokens must be an integer, got {echo(max_tokens)}")
        if not 1 <= max_tokens <= self.config.max_tokens_limit:
            raise InvalidInputError(f"max_tokens must be between 1 and {self.config.max_tokens_limit}")
        sampling = check_sampling(request, max_tokens)
        session = self.sessions.get(request.session_id) if request.session_id is not None else None
        if session is not None:  # told before admission; stream() claims the session
            self.sessions.ensure_idle(session)
        # Rejects over-long questions before any work; the tokens serve every prompt of the query.
        question_token_ids = tuple(self.builder.question_tokens(request.question))
        return CheckedRequest(request, k, mode, sampling, session, question_token_ids)

    async def answer(self, request: RagRequest | CheckedRequest) -> AnswerDone:
        """Run a query to the end and return the whole answer."""
        async with contextlib.aclosing(self.stream(request)) as events:
            async for event in events:
                if isinstance(event, AnswerDone):
                    return event
        raise EngineError("the answer stream ended without a result")

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
            self.speculation,
        )

    # ------------------------------------------------------------------ the rest of the facade

    def load(self) -> CoreLoad:
        return CoreLoad(prefill_pool=self.gate.pool, queued=self.gate.waiting)

    async def health(self) -> EngineHealth:
        """Whether an engine answers (its own counts), with the first's supervisor status if it has one.

        With several replicas the service serves while any replica does: one replica down (or
        restarting) is routed around, not a reason to turn callers away.
        """
        supervision = self.engine.supervision
        status = supervision.status() if supervision is not None else None
        reasons = []
        for replica in self.placement.replicas:
            try:
                if replica.excluded is not None:
                    raise EngineError(f"excluded: {replica.excluded}")
                await replica.engine.counts()
            except EngineError as error:
                alone = len(self.placement.replicas) == 1
                reasons.append(str(error) if alone else f"{replica.name}: {error}")
                continue
            return EngineHealth(serving=True, reason=None, supervision=status)
        return EngineHealth(serving=False, reason="; ".join(reasons), supervision=status)

    def create_session(self, client: str) -> str:
        return self.sessions.create(client).session_id

    def close_session(self, session_id: str) -> None:
        self.sessions.close(session_id)

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


def new_tree(engine: Engine, system_token_ids: Sequence[int]) -> KnowledgeTree:
    """An empty knowledge tree for an engine: its block size, and its capacity model until events come."""
    capacity = engine.kv_capacity_tokens
    return KnowledgeTree(
        system_token_ids,
        block_size=engine.block_size,
        capacity_blocks=capacity // engine.block_size if capacity else None,
    )
