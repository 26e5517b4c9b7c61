"""Where a prompt runs and in which document order: chosen together, per replica.

A query asks its :class:`Placement` "where, and in which order?" instead of ordering against one
tree. With one replica the answer is trivial (that replica, the ordering policy against its tree).
With several, the router decides; :data:`ROUTERS` names the ones specrag offers:

- ``specrag`` (the default, joint routing): for every candidate replica, order the documents
  against *that replica's* exact tree, build the prompt, and estimate its TTFT there: the prefill
  work already queued on the replica plus this prompt's prefill behind its predicted cached
  tokens, both scaled by the replica's measured speed. The lowest estimate wins. Routers that
  exist route a prompt whose order is fixed; knowing the documents before the prompt exists lets
  specrag pick the replica *and* the order that together give the longest cached prefix.
- ``exact_retrieval_order``: the same exact trees and estimate, documents in retrieval order:
  what a precise KV-event router (llm-d, Dynamo) does with a prompt it is handed.
- ``approx_prefix``: an approximate prompt-prefix tree of the requests routed to each replica
  (no eviction knowledge), longest match wins unless that replica's queue exceeds the least
  loaded one's by the imbalance bound (Ray Serve's and SGLang's routers).
- ``least_loaded`` (fewest of our prefills pending) and ``round_robin``.

Every router but round-robin respects the imbalance bound: a replica with more than
``imbalance_bound`` pending prefills beyond the least loaded one is not a candidate, so prefix
affinity cannot pile a hot prefix onto one replica. A prompt whose order is fixed (a session's
later turn: history first) goes through the same routers with the order left alone, so a
session's next turn prefers the replica holding its prefix. Speculation asks the same question
at each stage (so the speculation runs where the final prompt would), and the final placement
breaks ties towards the speculation's replica so that adoption stays possible.

Faults: a replica whose request fails is excluded at once (:meth:`Replica.exclude`); a health
check (:meth:`Placement.run_health_checks`) brings it back once its engine answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass

from specrag.cache.layout import DocId, PromptLayout
from specrag.cache.ordering import OrderingPolicy, PolicyName, get_policy
from specrag.cache.residency import chain_block_keys
from specrag.cache.tree import KnowledgeTree
from specrag.controller.replicas import Replica
from specrag.errors import EngineError, EngineUnavailableError, InvalidInputError, check_choice
from specrag.pipeline.engines.protocol import Engine

__all__ = [
    "DEFAULT_IMBALANCE_BOUND",
    "ROUTERS",
    "STALL_TIMEOUT_S",
    "Build",
    "Placed",
    "Placement",
    "PlacementMemo",
    "Router",
    "health_checks",
]

logger = logging.getLogger(__name__)


class Router(enum.StrEnum):
    """The routers specrag offers (module doc)."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    APPROX_PREFIX = "approx_prefix"
    EXACT_RETRIEVAL_ORDER = "exact_retrieval_order"
    SPECRAG = "specrag"


ROUTERS: tuple[Router, ...] = tuple(Router)
DEFAULT_IMBALANCE_BOUND = 2
# Entries of the approximate prefix tree per replica (block keys), as a router's own memory cap.
_APPROX_KEYS = 1 << 16
# A one-token prompt: the cheapest request that proves an engine still steps.
_PROBE_PROMPT = (1,)

Build = Callable[[Sequence[DocId]], PromptLayout]
"""Builds the prompt for documents in a given order (the caller knows the question and hints)."""


STALL_TIMEOUT_S = 10.0
"""A replica whose pending requests got no first token for this long past their expected time is
excluded; a first-token timeout (60 s by default) would leave its queries waiting far longer."""


@dataclass(frozen=True)
class Placed:
    """Where a prompt goes, the prompt itself, and why.

    ``predicted_cached`` is what that replica's tree expects the engine to reuse; ``estimate_s``
    the router's TTFT estimate there (0 for routers that make none).
    """

    replica: Replica
    layout: PromptLayout
    predicted_cached: int
    estimate_s: float
    reason: str


class PlacementMemo:
    """One query's orderings and prompts, kept across its stages and its final placement.

    A stage's running top-k is often the stage before's: ordering it again against a replica's
    tree that has not changed since (:attr:`~specrag.cache.tree.KnowledgeTree.version`) gives the
    same order, and the same documents in the same order give the same prompt (a query's question,
    hints and store rows do not change while it runs), whose block keys are then hashed once.
    """

    def __init__(self) -> None:
        self._orders: dict[tuple[KnowledgeTree, int, str, tuple[DocId, ...]], tuple[DocId, ...]] = {}
        self._layouts: dict[tuple[tuple[DocId, ...], tuple[DocId, ...]], PromptLayout] = {}
        self._hits: dict[tuple[KnowledgeTree, int, int], int] = {}

    def order(
        self, policy: OrderingPolicy, tree: KnowledgeTree, doc_ids: tuple[DocId, ...]
    ) -> tuple[DocId, ...]:
        """``policy``'s order of ``doc_ids`` against ``tree`` as it is now."""
        key = (tree, tree.version, policy.name, doc_ids)
        order = self._orders.get(key)
        if order is None:
            order = self._orders[key] = policy.order(tree, doc_ids).doc_ids
        return order

    def layout(self, build: Build, doc_ids: tuple[DocId, ...], order: tuple[DocId, ...]) -> PromptLayout:
        """The prompt ``build`` makes of ``doc_ids`` in ``order``."""
        key = (doc_ids, order)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = build(order)
        return layout

    def hit(self, tree: KnowledgeTree, layout: PromptLayout) -> int:
        """``tree.prompt_hit(layout)`` now, for a ``layout`` of :meth:`layout` (kept, so its id is
        not reused while the memo lives)."""
        tree.expire_predictions()  # as prompt_hit does first: the version then says it all
        key = (tree, tree.version, id(layout))
        hit = self._hits.get(key)
        if hit is None:
            hit = self._hits[key] = tree.prompt_hit(layout)
        return hit


class _ApproxPrefixes:
    """What an approximate router believes a replica holds: block keys of prompts it routed there."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._keys: OrderedDict[int, None] = OrderedDict()

    def match(self, token_ids: Sequence[int]) -> int:
        """Leading blocks of the prompt this replica was sent before (tokens)."""
        count = 0
        for key in chain_block_keys(token_ids, self._block_size):
            if key not in self._keys:
                break
            self._keys.move_to_end(key)
            count += 1
        return count * self._block_size

    def insert(self, token_ids: Sequence[int]) -> None:
        for key in chain_block_keys(token_ids, self._block_size):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > _APPROX_KEYS:
            self._keys.popitem(last=False)


class Placement:
    """The replicas of one controller and the router that places prompts on them (module doc)."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        router: Router | str = Router.SPECRAG,
        imbalance_bound: int = DEFAULT_IMBALANCE_BOUND,
    ) -> None:
        if not replicas:
            raise InvalidInputError("a placement needs at least one replica")
        if imbalance_bound < 0:
            raise InvalidInputError(f"imbalance_bound cannot be negative, got {imbalance_bound}")
        names = [replica.name for replica in replicas]
        if len(set(names)) != len(names):
            raise InvalidInputError(f"replica names must be distinct, got {names}")
        block_sizes = {replica.engine.block_size for replica in replicas}
        if len(block_sizes) != 1:
            raise InvalidInputError(f"replicas must share one KV block size, got {sorted(block_sizes)}")
        self.replicas = tuple(replicas)
        self.router = check_choice("router", router, Router)
        self.imbalance_bound = imbalance_bound
        self._turn = itertools.count()
        self._approx = {replica.name: _ApproxPrefixes(replica.engine.block_size) for replica in replicas}

    @classmethod
    def of_one(cls, engine: Engine, system_token_ids: Sequence[int]) -> Placement:
        """One engine as a pool of one (its replica is named "0")."""
        return cls([Replica.for_engine("0", engine, system_token_ids)])

    # ------------------------------------------------------------------ placing prompts

    def place_documents(
        self,
        policy: OrderingPolicy,
        doc_ids: Sequence[DocId],
        build: Build,
        *,
        prefer: Replica | None = None,
        memo: PlacementMemo | None = None,
    ) -> Placed:
        """The replica and document order for a prompt over these documents (module doc); a
        query's ``memo`` keeps its orders and prompts from one of its placements to the next."""
        candidates = self._candidates(())
        memo = memo or PlacementMemo()
        ids = tuple(doc_ids)

        def prompt_for(by: OrderingPolicy) -> Callable[[Replica], tuple[PromptLayout, int]]:
            def prompt(replica: Replica) -> tuple[PromptLayout, int]:
                layout = memo.layout(build, ids, memo.order(by, replica.tree, ids))
                return layout, memo.hit(replica.tree, layout)

            return prompt

        if len(self.replicas) == 1 or self.router is Router.SPECRAG:
            return self._joint(candidates, prompt_for(policy), prefer)
        retrieval = get_policy(PolicyName.RETRIEVAL)
        if self.router is Router.EXACT_RETRIEVAL_ORDER:
            return self._joint(candidates, prompt_for(retrieval), prefer)
        return self.place_prompt(build(retrieval.order(candidates[0].tree, doc_ids).doc_ids))

    def place_prompt(
        self, layout: PromptLayout, *, prefer: Replica | None = None, avoid: Collection[Replica] = ()
    ) -> Placed:
        """The replica for a prompt whose order is fixed (a session's later turn)."""
        candidates = self._candidates(avoid)
        tokens = layout.token_ids
        if len(self.replicas) == 1 or self.router in (Router.SPECRAG, Router.EXACT_RETRIEVAL_ORDER):
            options = [self._estimate(r, layout, r.tree.cached_tokens(tokens)) for r in candidates]
            return self._best(options, prefer)
        if self.router is Router.ROUND_ROBIN:
            replica = candidates[next(self._turn) % len(candidates)]
            return Placed(replica, layout, replica.tree.cached_tokens(tokens), 0.0, "round robin")
        least = min(candidates, key=lambda r: (r.pending, r.wait_s()))
        if self.router is Router.LEAST_LOADED:
            return Placed(least, layout, least.tree.cached_tokens(tokens), 0.0, "least loaded")
        matches = {r.name: self._approx[r.name].match(tokens) for r in candidates}
        chosen, reason = least, "least loaded"
        best = max(candidates, key=lambda r: matches[r.name])
        if matches[best.name] > 0 and best.pending <= least.pending + self.imbalance_bound:
            chosen, reason = best, "longest routed prefix"
        self._approx[chosen.name].insert(tokens)
        return Placed(chosen, layout, chosen.tree.cached_tokens(tokens), 0.0, reason)

    def _candidates(self, avoid: Collection[Replica]) -> list[Replica]:
        """Available replicas (those not to avoid, if any), within the imbalance bound of the least loaded."""
        available = [r for r in self.replicas if r.available]
        available = [r for r in available if r not in avoid] or available
        if not available:
            raise EngineUnavailableError(
                "no engine replica is available ("
                + "; ".join(f"{r.name}: {r.excluded or 'recovering'}" for r in self.replicas)
                + "); retry shortly"
            )
        if self.router is Router.ROUND_ROBIN:
            return available
        floor = min(r.pending for r in available)
        return [r for r in available if r.pending <= floor + self.imbalance_bound]

    def _joint(
        self,
        candidates: Sequence[Replica],
        prompt_for: Callable[[Replica], tuple[PromptLayout, int]],
        prefer: Replica | None,
    ) -> Placed:
        """Each candidate's own order of the documents against its tree, and its predicted hit
        there; the lowest estimate wins."""
        options = []
        for replica in candidates:
            layout, hit = prompt_for(replica)
            options.append(self._estimate(replica, layout, hit))
        return self._best(options, prefer)

    @staticmethod
    def _estimate(replica: Replica, layout: PromptLayout, cached: int) -> Placed:
        return Placed(replica, layout, cached, replica.ttft_s(cached, len(layout.token_ids)), "")

    def _best(self, options: Sequence[Placed], prefer: Replica | None) -> Placed:
        """Lowest estimate; ties go to the preferred replica (a speculation's), then the less loaded."""
        best = min(options, key=lambda p: (p.estimate_s, p.replica is not prefer, p.replica.pending))
        reason = "only replica" if len(self.replicas) == 1 else "lowest estimated TTFT"
        if best.replica is prefer and len(options) > 1:
            reason = "speculation's replica"
        return Placed(best.replica, best.layout, best.predicted_cached, best.estimate_s, reason)

    # ------------------------------------------------------------------ faults

    def report_failure(self, replica: Replica, reason: str) -> None:
        """A request on ``replica`` failed: its supervisor hears of it; with others left, it is excluded.

        With one replica there is nowhere else to go: its supervisor (if any) recovers it and
        the query waits for that, as with a single engine.
        """
        supervision = replica.engine.supervision
        if supervision is not None:
            supervision.report_failure(reason)
        if len(self.replicas) > 1:
            replica.exclude(reason)

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait (bounded) until a replica is available; with one replica, for its supervisor's recovery."""
        if len(self.replicas) == 1:
            supervision = self.replicas[0].engine.supervision
            return supervision is None or await supervision.wait_ready(timeout_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not any(r.available for r in self.replicas):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def run_health_checks(
        self, every_s: float = 0.5, probe_timeout_s: float = 5.0, stall_timeout_s: float = STALL_TIMEOUT_S
    ) -> None:
        """Forever (run as a task): exclude a replica whose engine knows it failed or that stalled,
        so what waits on it is retried elsewhere, and bring back an excluded replica once its
        engine answers.

        A check that comes late by more than its interval finds this process itself was paused
        (its event loop blocked, or the machine did not run it): the first tokens that arrived
        meanwhile are not seen yet, so every replica would look silent. It judges no stall then and
        counts each replica's silence from that moment.
        """
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + every_s
            await asyncio.sleep(every_s)
            if loop.time() - due > every_s:
                for replica in self.replicas:
                    replica.excuse_pause()
            for replica in self.replicas:
                if replica.excluded is None:
                    if (failure := replica.engine.known_failure()) is not None:
                        replica.exclude(failure)
                    elif (over := replica.stalled_for(stall_timeout_s)) is not None:
                        replica.exclude(f"stalled: no first token for {stall_timeout_s + over:.1f} s")
                elif await _answers(replica, probe_timeout_s):
                    await replica.rejoin()


async def _answers(replica: Replica, timeout_s: float) -> bool:
    """The replica computes a one-token request in time, and its supervisor (if any) is ready.

    A request, not a status call: a stalled engine still reports its queues, it just never steps.
    """
    supervision = replica.engine.supervision
    if supervision is not None and supervision.status().state != "ready":
        return False
    try:
        async with asyncio.timeout(timeout_s):
            await replica.engine.warm(_PROBE_PROMPT, f"probe-{replica.name}-{uuid.uuid4().hex}")
    except (EngineError, TimeoutError):
        return False
    return True


@contextlib.asynccontextmanager
async def health_checks(
    placement: Placement, every_s: float = 0.5, stall_timeout_s: float = STALL_TIMEOUT_S
) -> AsyncIterator[Placement]:
    """Run the placement's health checks while the block runs (nothing to check with one replica)."""
    task = None
    if len(placement.replicas) > 1:
        checks = placement.run_health_checks(every_s, stall_timeout_s=stall_timeout_s)
        task = asyncio.create_task(checks)
    try:
        yield placement
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
