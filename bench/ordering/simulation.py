"""The simulated engine of bench.ordering: vLLM's prefix cache at block granularity, publishing
vLLM-like KV events, and the server that runs prompts through it with the knowledge tree mirroring it."""

from __future__ import annotations

import bisect
import functools
import json
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.ordering.score import score
from bench.traces import TraceRequest
from specrag.cache import (
    BlockRemoved,
    BlockStored,
    DocId,
    KnowledgeTree,
    KVEvent,
    PrefixMatch,
    PromptLayout,
    build_layout,
)
from specrag.cache.residency import ROOT_KEY, BlockPool, chain_block_keys

BLOCK_SIZE = 32  # the service's KV block (EngineConfig.block_size)
PAD_TOKEN = 0
SYSTEM_TOKENS = tuple(range(1, 65))
QUESTION_LEN = 16


@functools.cache
def doc_tokens(doc_id: DocId) -> tuple[int, ...]:
    """Deterministic synthetic tokens of a document (ids 1000+), padded to a block multiple."""
    seed = zlib.crc32(f"{type(doc_id).__name__}:{doc_id}".encode())
    rng = np.random.default_rng(seed)
    length = 24 + seed % 176
    tokens = tuple(int(t) for t in rng.integers(1000, 50_000, size=length))
    return tokens + (PAD_TOKEN,) * (-length % BLOCK_SIZE)


class SimulatedAPC:
    """vLLM's prefix cache (the shared :class:`BlockPool` model), publishing vLLM-like events.

    Each prompt runs start to finish before the next (:meth:`BlockPool.serve`): reuse depends on
    the block pool's contents and eviction order, not on timing, so no engine steps are simulated.
    """

    def __init__(self, capacity_blocks: int | None) -> None:
        self._lru = BlockPool(capacity_blocks)

    def serve(self, token_ids: Sequence[int]) -> tuple[int, list[KVEvent]]:
        """Run one prompt: return its cached blocks and the events its blocks caused."""
        keys = chain_block_keys(token_ids, BLOCK_SIZE)
        served = self._lru.serve(keys)
        new = set(served.stored)
        events: list[KVEvent] = []
        run: list[int] = []
        for i, key in enumerate([*keys, None]):  # one BlockStored per run of consecutive new blocks
            if key in new:
                run.append(i)
                continue
            if run:
                parent = _engine_hash(keys[run[0] - 1]) if run[0] else None
                tokens = tuple(token_ids[run[0] * BLOCK_SIZE : (run[-1] + 1) * BLOCK_SIZE])
                events.append(
                    BlockStored(tuple(_engine_hash(keys[j]) for j in run), parent, tokens, BLOCK_SIZE)
                )
                run = []
        if served.evicted:
            events.append(BlockRemoved(tuple(_engine_hash(k) for k in served.evicted)))
        return served.cached_blocks, events

    def probe(self) -> Callable[[Sequence[DocId]], PrefixMatch]:
        """Ground-truth reuse of a document order, memoised per prefix (for the oracle)."""
        system_keys = chain_block_keys(SYSTEM_TOKENS, BLOCK_SIZE)
        root = _ProbeState(
            blocks=len(system_keys),
            leading=self._lru.leading_cached(system_keys),
            last_key=system_keys[-1] if system_keys else ROOT_KEY,
            pending=SYSTEM_TOKENS[len(system_keys) * BLOCK_SIZE :],
            ends=(),
        )
        memo: dict[tuple[DocId, ...], _ProbeState] = {(): root}

        def state(prefix: tuple[DocId, ...]) -> _ProbeState:
            if prefix not in memo:
                parent = state(prefix[:-1])
                document = doc_tokens(prefix[-1])
                start = parent.ends[-1] if parent.ends else len(SYSTEM_TOKENS)
                tokens = parent.pending + document
                keys = chain_block_keys(tokens, BLOCK_SIZE, parent.last_key)
                leading = parent.leading
                if leading == parent.blocks:
                    leading += self._lru.leading_cached(keys)
                memo[prefix] = _ProbeState(
                    blocks=parent.blocks + len(keys),
                    leading=leading,
                    last_key=keys[-1] if keys else parent.last_key,
                    pending=tokens[len(keys) * BLOCK_SIZE :],
                    ends=(*parent.ends, start + len(document)),
                )
            return memo[prefix]

        def probe(prefix: Sequence[DocId]) -> PrefixMatch:
            s = state(tuple(prefix))
            tokens = s.leading * BLOCK_SIZE
            return PrefixMatch(cached_docs(s.ends, tokens), tokens, s.leading == s.blocks)

        return probe


@dataclass(frozen=True, slots=True)
class _ProbeState:
    blocks: int  # full blocks up to the end of the prefix's documents
    leading: int  # of those, how many are cached from the first
    last_key: int
    pending: tuple[int, ...]  # tokens after the last full block
    ends: tuple[int, ...]  # end offset of each document


def _engine_hash(key: int) -> int:
    """The engine's own hash differs from our content key; the tree must translate."""
    return hash(("engine", key))


def cached_docs(segment_ends: Sequence[int], cached_tokens: int) -> int:
    """Leading documents lying entirely inside the reused blocks."""
    return bisect.bisect_right(segment_ends, cached_tokens)


def prompt_tokens(docs: Sequence[DocId]) -> int:
    return len(SYSTEM_TOKENS) + sum(len(doc_tokens(d)) for d in docs) + QUESTION_LEN


@dataclass
class RunResult:
    policy: str
    order: list[tuple[int | str, tuple[DocId, ...]]] = field(default_factory=list)
    slots: int = 0
    cached_slots: int = 0
    tokens: int = 0
    cached_tokens: int = 0
    overhead_us: list[float] = field(default_factory=list)  # wall clock: includes preemption
    overhead_cpu_us: list[float] = field(default_factory=list)  # this thread's CPU time only
    index_s: float | None = None
    index_cpu_s: float | None = None
    replay: dict[str, float] | None = None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "slot_reuse": self.cached_slots / max(self.slots, 1),
            "token_reuse": self.cached_tokens / max(self.tokens, 1),
            "independent": score([docs for _, docs in self.order]),
        }
        for name, values in (("overhead_us", self.overhead_us), ("overhead_cpu_us", self.overhead_cpu_us)):
            if values:
                out[f"{name}_p50"] = float(np.percentile(values, 50))
                out[f"{name}_p99"] = float(np.percentile(values, 99))
        if self.index_s is not None:
            out["index_s"] = self.index_s
            out["index_cpu_s"] = self.index_cpu_s
        if self.replay is not None:
            out["replay"] = self.replay
        return out

    def emitted(self) -> str:
        return "".join(json.dumps({"rid": rid, "docs": list(docs)}) + "\n" for rid, docs in self.order)


class Server:
    """The simulated engine, the knowledge tree mirroring it, and the run's accounting."""

    def __init__(self, capacity_blocks: int | None, result: RunResult) -> None:
        self.engine = SimulatedAPC(capacity_blocks)
        self.tree = KnowledgeTree(SYSTEM_TOKENS, block_size=BLOCK_SIZE, max_nodes=500_000)
        self.result = result

    def prompt_tokens(self, request: TraceRequest) -> int:
        return prompt_tokens(request.docs)

    def question(self) -> tuple[int, ...]:
        """The next request's question tokens: every prompt gets its own."""
        start = 900_000 + len(self.result.order) * QUESTION_LEN
        return tuple(range(start, start + QUESTION_LEN))

    def layout(self, docs: Sequence[DocId], question: Sequence[int]) -> PromptLayout:
        """The prompt as the service lays it out (``specrag.pipeline.store.prompt.PromptBuilder``)."""
        return build_layout(
            SYSTEM_TOKENS,
            [(d, doc_tokens(d)) for d in docs],
            question,
            block_size=BLOCK_SIZE,
            pad_token_id=PAD_TOKEN,
        )

    def serve(self, request: TraceRequest, docs: Sequence[DocId], layout: PromptLayout | None = None) -> int:
        """Run one prompt through the engine, update the mirror; return its cached tokens."""
        layout = layout or self.layout(docs, self.question())
        cached_blocks, events = self.engine.serve(layout.token_ids)
        cached = cached_blocks * BLOCK_SIZE
        ends = [s.end for s in layout.segments if s.kind == "document"]
        self.tree.record_served(layout, cached)
        self.tree.apply_events(events)
        result = self.result
        result.order.append((request.rid, tuple(docs)))
        result.slots += len(docs)
        result.cached_slots += cached_docs(ends, cached)
        result.tokens += len(layout.token_ids)
        result.cached_tokens += cached
        return cached
