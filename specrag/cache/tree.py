"""The knowledge tree: a document-ID trie that mirrors what the engine's prefix cache holds.

The root is the system prompt; a node is "this document at this position after this prefix",
because a document's KV depends on everything before it. Each node owns the KV blocks that
*complete* inside its token span, keyed by chained content (see residency.py). A block that
straddles two documents completes in the second one, so it belongs to the child: a document
that ends mid-block is only cached up to its last full block unless the same next document
follows. A node is resident while all its blocks are stored and its parent is resident; a
document counts as reused only when every block holding its tokens is, so one ending mid-block
depends on the block that contains its end (owned by whatever follows it).

Residency comes from the engine's KV events when it publishes them (exact), otherwise from a
capacity model of its LRU block pool. The tree never owns KV; it only decides prompt order.
Memory stays bounded: past ``max_nodes`` the mirror forgets non-resident leaves first, then the
resident leaves of lowest PGDSF priority.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import itemgetter
from typing import NamedTuple

from specrag.cache.events import AllBlocksCleared, KVEvent
from specrag.cache.layout import DocId, PromptLayout, Segment
from specrag.cache.pgdsf import PgdsfStats, PrefillProfile
from specrag.cache.residency import BlockPool, BlockResidency, CopyKey, ResidencyCounts, chain_block_keys
from specrag.errors import InvalidInputError

__all__ = ["MAX_COMPANIONS", "KnowledgeTree", "Node", "PrefixMatch"]

_NO_COMPANIONS: Mapping[DocId, int] = {}
MAX_COMPANIONS = 64
"""Companions remembered per document; past it only the most frequent half is kept."""


class Node:
    """One document at one position after one prefix (the root: the system prompt)."""

    __slots__ = (
        "children",
        "doc_id",
        "end",
        "first_block",
        "keys",
        "last_use",
        "missing",
        "parent",
        "pgdsf",
        "start",
    )

    def __init__(self, doc_id: DocId | None, parent: Node | None, start: int, end: int) -> None:
        self.doc_id = doc_id
        self.parent = parent
        self.children: dict[DocId, Node] = {}
        self.start = start
        self.end = end
        self.first_block = 0
        self.keys: tuple[int, ...] = ()
        self.missing = 0
        self.last_use = 0
        self.pgdsf = PgdsfStats()

    @property
    def hits(self) -> int:
        return self.pgdsf.frequency


class PrefixMatch(NamedTuple):
    """What the engine would reuse of a prompt: tokens (whole blocks) and the leading documents
    lying entirely inside them. ``unbroken``: every block completing inside the documents is
    cached, so a longer document list could reuse more.

    A named tuple rather than a dataclass: one is made for every ordered request, and a tuple is
    built three times faster than a frozen dataclass instance.
    """

    docs: int
    tokens: int
    unbroken: bool = False


class KnowledgeTree:
    """Mirror of the engine's prefix cache over document orders.

    ``capacity_blocks=None`` means residency comes only from :meth:`apply_events`; an integer
    enables the capacity model (the engine's KV block count) until the first event arrives.
    """

    def __init__(
        self,
        system_token_ids: Sequence[int],
        *,
        block_size: int,
        capacity_blocks: int | None = None,
        max_nodes: int = 100_000,
        max_docs: int = 1_000_000,
        profile: PrefillProfile | None = None,
    ) -> None:
        if block_size <= 0 or max_nodes <= 0 or max_docs <= 1:
            raise InvalidInputError("block_size, max_nodes and max_docs must be positive")
        self.block_size = block_size
        self.max_nodes = max_nodes
        self._max_docs = max_docs
        self._profile = profile or PrefillProfile()
        self._system = tuple(system_token_ids)
        self._owners: dict[int, list[Node]] = {}
        self._residency = BlockResidency(block_size, self._on_block_change)
        self._stored = self._residency.stored
        self._lru = BlockPool(capacity_blocks) if capacity_blocks is not None else None
        self._size = 0
        self._tick = 0
        self._clock = 0.0
        self._doc_hits: dict[DocId, int] = {}
        self._doc_last: dict[DocId, int] = {}
        self._companions: dict[DocId, dict[DocId, int]] = {}
        # Rises with every change of what an ordering reads (paths, uses, residency), so that a
        # caller may keep an ordering made against this tree for as long as it stays the same.
        self.version = 0
        self.root = Node(None, None, 0, len(self._system))
        self._assign_keys(self.root, chain_block_keys(self._system, block_size))

    # ----------------------------------------------------------------- queries

    def __len__(self) -> int:
        """Number of document nodes (the root not counted)."""
        return self._size

    @property
    def profile(self) -> PrefillProfile:
        """The prefill profile PGDSF costs come from (``profile.measured``: fitted on the engine)."""
        return self._profile

    def use_profile(self, profile: PrefillProfile) -> None:
        """Cost later misses with ``profile`` (a fit of the engine in use); past costs stay."""
        self._profile = profile

    @property
    def uses_capacity_model(self) -> bool:
        return self._lru is not None

    @property
    def stored_blocks(self) -> int:
        """Distinct content-keyed blocks believed stored in the engine."""
        return len(self._residency)

    def nodes(self) -> Iterator[Node]:
        """All nodes, root first, depth first."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def popularity(self, doc_id: DocId) -> int:
        """How many served prompts contained the document (bounded memory: rare ones forgotten)."""
        return self._doc_hits.get(doc_id, 0)

    def companions(self, doc_id: DocId) -> Mapping[DocId, int]:
        """How many served prompts held each other document together with ``doc_id``."""
        return self._companions.get(doc_id, _NO_COMPANIONS)

    def companion_rows(self, doc_ids: Iterable[DocId]) -> list[Mapping[DocId, int]]:
        """:meth:`companions` of each document, in one call (ordering reads k rows per request)."""
        return list(map(self._companions.get, doc_ids, repeat(_NO_COMPANIONS)))

    def last_used(self, doc_id: DocId) -> int:
        """Logical time the document was last served, -1 if never (or forgotten)."""
        return self._doc_last.get(doc_id, -1)

    def system_prompt_resident(self) -> bool:
        """Whether the system prompt's full blocks are in the engine (else: warm it up)."""
        return self.root.missing == 0

    def resident_tokens(self, node: Node) -> int:
        """Tokens reused when ``node`` (resident, with all ancestors) ends the cached prefix."""
        return node.end // self.block_size * self.block_size

    def partial_tokens(self, node: Node) -> int:
        """Tokens reused up to a non-resident ``node``: the leading stored blocks of its span."""
        stored = self._stored  # count_leading inlined: ordering calls this per candidate
        leading = 0
        for key in node.keys:
            if key not in stored:
                break
            leading += 1
        return (node.first_block + leading) * self.block_size

    def cached_prefix(self, doc_ids: Sequence[DocId]) -> PrefixMatch:
        """What the engine would reuse of a prompt with these documents in this order."""
        node = self.root
        if node.missing:
            return PrefixMatch(0, self.partial_tokens(node))
        ends: list[int] = []
        partial: Node | None = None
        for doc_id in doc_ids:
            child = node.children.get(doc_id)
            if child is None:
                break
            if child.missing:
                partial = child
                break
            node = child
            ends.append(child.end)
        tokens = self.partial_tokens(partial) if partial is not None else self.resident_tokens(node)
        return PrefixMatch(bisect_right(ends, tokens), tokens, len(ends) == len(doc_ids))

    def prompt_hit(self, layout: PromptLayout) -> int:
        """What the engine would reuse of this prompt of documents: its documents' path and, past
        it, the question's full blocks when the same prompt was computed before (identical
        requests at once, a repeat), which the engine reuses as well."""
        documents = self.cached_prefix(layout.document_ids()).tokens  # before predictions expire
        usable = (len(layout.token_ids) - 1) // self.block_size
        return max(documents, self._leading_stored(layout.block_keys(self.block_size)[:usable]))

    def cached_tokens(self, token_ids: Sequence[int]) -> int:
        """What the engine would reuse of any prompt whose token order is fixed (a session's turn).

        The resident leading blocks by content key, capped like the engine's hit: the last prompt
        token is always computed, so an exact repeat reuses all blocks but the one holding it.
        """
        usable = (len(token_ids) - 1) // self.block_size
        return self._leading_stored(chain_block_keys(token_ids[: usable * self.block_size], self.block_size))

    def expire_predictions(self) -> None:
        """Drop the predictions past their bound now, as every read of the stored blocks does
        first: a caller that keeps an answer while :attr:`version` stays calls it before looking."""
        self._residency.expire_predictions()

    def _leading_stored(self, keys: Sequence[int]) -> int:
        """Tokens of the run of ``keys`` believed stored from the first (predictions past their
        bound dropped first)."""
        self._residency.expire_predictions()
        return self._residency.leading_stored(keys) * self.block_size

    # ----------------------------------------------------------------- updates

    def record_served(self, layout: PromptLayout, cached_tokens: int | None = None) -> None:
        """Insert the served prompt's document path and update hits, recency and PGDSF costs.

        ``cached_tokens`` is the engine's own prefix hit for the request when known (vLLM's
        ``num_cached_tokens``); otherwise the tree's estimate is used, which is right as long as
        the request's own BlockStored events have not been applied yet.
        """
        self.version += 1
        system, documents = self._split(layout)
        doc_ids = [seg.doc_id for seg in documents if seg.doc_id is not None]
        if cached_tokens is None:
            cached_tokens = self.cached_prefix(doc_ids).tokens
        prefix_end = documents[-1].end if documents else system.end
        keys = layout.block_keys(self.block_size)
        if self._lru is None:
            keys = keys[: prefix_end // self.block_size]
        computed = len(layout.token_ids) - cached_tokens
        cost = self._profile.cost(cached_tokens, computed) / computed if computed > 0 else None
        self._tick += 1
        for node in self._path(system, documents, keys):
            self._visit(node, cached_tokens, cost)
        for doc_id in doc_ids:
            self._doc_hits[doc_id] = self._doc_hits.get(doc_id, 0) + 1
            self._doc_last[doc_id] = self._tick
            row = self._companions.setdefault(doc_id, {})
            for other in doc_ids:
                row[other] = row.get(other, 0) + 1
            if len(row) > MAX_COMPANIONS:
                keep = heapq.nlargest(MAX_COMPANIONS // 2, row.items(), key=itemgetter(1))
                self._companions[doc_id] = dict(keep)
        if self._lru is not None:
            served = self._lru.serve(keys)
            for key in served.stored:
                self._residency.store(key)
            for key in served.evicted:
                self._residency.remove(key)
        if self._size > self.max_nodes:
            self._prune()
        if len(self._doc_hits) > self._max_docs:
            self._forget_rare_docs()

    def record_pending(self, layout: PromptLayout) -> None:
        """The engine was just handed this prompt: its document path exists from now on.

        Its blocks then count for the prompts placed before its first token as soon as their KV
        events arrive (a chunked prefill stores the leading ones first), and those prompts' ordering
        can follow its path instead of starting an order of their own. Its use is counted only at
        :meth:`record_served`, when it was served.
        """
        self.version += 1
        system, documents = self._split(layout)
        prefix_end = documents[-1].end if documents else system.end
        self._path(system, documents, layout.block_keys(self.block_size)[: prefix_end // self.block_size])
        if self._size > self.max_nodes:
            self._prune()

    def record_prefilled(self, layout: PromptLayout, *, salted: bool = False) -> None:
        """The engine just prefilled this prompt: its full blocks are cached now.

        For a tree that follows KV events (with the capacity model, :meth:`record_served` already
        serves the prompt): the blocks count as stored until their events confirm them, so a
        prediction made before the events arrive is not behind the engine; one no event confirms
        is dropped after a bound (see :class:`BlockResidency`). A ``salted`` prompt (document KV
        loaded under its own cache salt) stored other blocks than these: it predicts nothing.
        """
        self.version += 1
        if self._lru is not None or salted:
            return
        self._split(layout)  # a prompt of the documents' layout (not a session's history), checked
        # Every full block of the prompt, the question's too: the engine caches them all, and
        # the same question again (identical requests at once, a repeat) reuses them.
        for key in layout.block_keys(self.block_size):
            self._residency.expect(key)

    def apply_events(self, events: Iterable[KVEvent]) -> None:
        """Apply one batch of the engine's KV events in order, all or nothing: every event is
        checked first (:class:`InvalidInputError` applies none). The first event retires the
        capacity model."""
        self.version += 1
        batch = list(events)
        for event in batch:
            if not isinstance(event, AllBlocksCleared):
                self._residency.check(event)
        if self._lru is not None:
            self._lru = None
            self._reset_residency(engine_cleared=False)
        self._residency.expire_predictions()
        for event in batch:
            if isinstance(event, AllBlocksCleared):
                self._reset_residency(engine_cleared=True)
            else:
                self._residency.apply(event)

    @property
    def mirror_counts(self) -> ResidencyCounts:
        """Duplicate copies, unknown removals and expired predictions seen since the tree was made."""
        return self._residency.counts

    def resident_hashes(self) -> set[CopyKey]:
        """The (group, medium, engine hash) entries the engine's events say it caches."""
        return self._residency.resident_hashes()

    @property
    def unconfirmed_predictions(self) -> int:
        """Blocks counted stored at a first token whose BlockStored has not arrived yet."""
        return self._residency.predictions

    def engine_cache_cleared(self) -> None:
        """The engine dropped its whole prefix cache (reset, restart): nothing is resident.

        Unlike an ``AllBlocksCleared`` event this keeps the capacity model when it is in use,
        for engines that publish no events.
        """
        self.version += 1
        if self._lru is not None:
            self._lru.clear()
        self._reset_residency(engine_cleared=True)

    # ----------------------------------------------------------------- internals

    def _split(self, layout: PromptLayout) -> tuple[Segment, list[Segment]]:
        """The system segment and the run of document segments right after it."""
        segments = layout.segments
        if not segments or segments[0].kind != "system":
            raise InvalidInputError("a served layout must start with the system prompt")
        system = segments[0]
        if layout.token_ids[: len(self._system)] != self._system or system.end < len(self._system):
            raise InvalidInputError("the served prompt's system prompt differs from the tree's")
        if system.end - len(self._system) >= self.block_size:
            # More than padding: a conversation's history laid out as the prompt's prefix. Its
            # documents sit at other positions than any first turn's, so recording them here
            # would re-key the tree's nodes with spans and blocks no other prompt can reuse.
            raise InvalidInputError(
                f"the served prompt's leading segment ({system.end} tokens) is longer than the tree's "
                f"system prompt ({len(self._system)}) plus padding: a session's history is not the tree's"
            )
        documents: list[Segment] = []
        for seg in segments[1:]:
            if seg.kind != "document" or seg.doc_id is None:
                break
            documents.append(seg)
        if len({seg.doc_id for seg in documents}) != len(documents):
            # ordering relies on it: no path of the tree holds a document twice
            raise InvalidInputError("a served prompt lists a document twice")
        return system, documents

    def _path(self, system: Segment, documents: Sequence[Segment], keys: Sequence[int]) -> list[Node]:
        """The root and the prompt's document nodes, each made where missing and re-keyed where its
        span or content changed."""
        node = self.root
        self._locate(node, system, keys)
        path = [node]
        for seg in documents:
            assert seg.doc_id is not None  # _split keeps only documents with ids
            child = node.children.get(seg.doc_id)
            if child is None:
                child = Node(seg.doc_id, node, seg.start, seg.end)
                node.children[seg.doc_id] = child
                self._size += 1
            self._locate(child, seg, keys)
            path.append(child)
            node = child
        return path

    def _locate(self, node: Node, seg: Segment, keys: Sequence[int]) -> None:
        """Re-key the node if its span or content changed."""
        owned = tuple(keys[seg.start // self.block_size : seg.end // self.block_size])
        if (node.start, node.end) != (seg.start, seg.end) or node.keys != owned:
            node.start, node.end = seg.start, seg.end
            self._assign_keys(node, owned)

    def _visit(self, node: Node, cached: int, cost: float | None) -> None:
        """Count this use of a located node."""
        node.last_use = self._tick
        node.pgdsf.record(self._clock, cost if node.end > cached else None)

    def _assign_keys(self, node: Node, keys: Sequence[int]) -> None:
        self._release_keys(node)
        node.keys = tuple(keys)
        node.first_block = node.start // self.block_size
        for key in node.keys:
            self._owners.setdefault(key, []).append(node)
        node.missing = sum(1 for key in node.keys if not self._residency.is_stored(key))

    def _release_keys(self, node: Node) -> None:
        for key in node.keys:
            owners = self._owners[key]
            owners.remove(node)
            if not owners:
                del self._owners[key]

    def _on_block_change(self, key: int, stored: bool) -> None:
        self.version += 1
        for node in self._owners.get(key, ()):
            if stored:
                node.missing -= 1
            else:
                if node.missing == 0:  # the engine evicted it: PGDSF's clock rises (eq. 2)
                    self._clock = max(self._clock, node.pgdsf.priority)
                node.missing += 1

    def _reset_residency(self, *, engine_cleared: bool) -> None:
        self.version += 1  # a clear tells no block's change: the version moves here
        self._residency.clear()
        for node in self.nodes():
            node.missing = len(node.keys)
            if engine_cleared:
                node.pgdsf.reset_frequency()

    def _prune(self) -> None:
        """Forget leaves down to 90 % of the cap: non-resident first, then lowest priority."""
        target = self.max_nodes * 9 // 10
        while self._size > target:
            leaves = [n for n in self.nodes() if not n.children and n.parent is not None]
            leaves.sort(key=lambda n: (n.missing == 0, n.pgdsf.priority, n.last_use))
            for node in leaves[: self._size - target]:
                if node.missing == 0:
                    self._clock = max(self._clock, node.pgdsf.priority)
                self._release_keys(node)
                assert node.parent is not None and node.doc_id is not None
                del node.parent.children[node.doc_id]
                self._size -= 1

    def _forget_rare_docs(self) -> None:
        keep = heapq.nlargest(self._max_docs // 2, self._doc_hits.items(), key=itemgetter(1))
        self._doc_hits = dict(keep)
        self._doc_last = {doc_id: self._doc_last[doc_id] for doc_id in self._doc_hits}
        self._companions = {
            doc_id: {other: n for other, n in self._companions[doc_id].items() if other in self._doc_hits}
            for doc_id in self._doc_hits
        }
