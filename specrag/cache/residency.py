"""Which KV blocks the engine holds, keyed by their chained token content.

vLLM's APC hashes every full block together with its parent's hash, so a block is reusable only
behind the exact same prefix. Its published hashes cannot be recomputed here (they are seeded
inside the engine), but a BlockStored event carries the tokens and the parent hash, so every
block gets a *content key* chained the same way: key = hash(parent key, block tokens). The
knowledge tree computes the same keys from the prompts it served, which links engine blocks to
tree nodes without ever seeing an engine hash in a prompt.

When the engine publishes no events, :class:`BlockPool` models its cache instead: vLLM's block
pool with its eviction order, the same model the simulated engine runs on.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

from specrag.cache.events import BlockHash, BlockRemoved, BlockStored
from specrag.errors import InvalidInputError

__all__ = [
    "ROOT_KEY",
    "BlockPool",
    "BlockResidency",
    "CopyKey",
    "ResidencyCounts",
    "Served",
    "chain_block_keys",
    "count_leading",
    "salted_root",
]

ROOT_KEY = 0
"""Parent key of a prompt's first block (vLLM's ``parent_block_hash=None``)."""


def salted_root(cache_salt: str) -> int:
    """The chain root of salted blocks: never the key of any unsalted prefix (64-bit hash aside).

    From the salt's SHA-256, not ``hash(str)``, which differs between processes.
    """
    return hash((ROOT_KEY, int.from_bytes(hashlib.sha256(cache_salt.encode()).digest()[:8], "little")))


def chain_block_keys(token_ids: Sequence[int], block_size: int, parent_key: int = ROOT_KEY) -> list[int]:
    """Content keys of the full blocks of ``token_ids``, which start on a block boundary.

    Python's tuple hash of ints is deterministic across processes; a 64-bit collision only makes
    the mirror wrong about one block, never the prompt.
    """
    tokens = tuple(token_ids)
    keys: list[int] = []
    key = parent_key
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = hash((key, tokens[start : start + block_size]))
        keys.append(key)
    return keys


def count_leading(keys: Sequence[int], present: Container[int]) -> int:
    """Length of the run of ``keys`` found in ``present`` from the first: APC stops at a miss."""
    count = 0
    for key in keys:
        if key not in present:
            break
        count += 1
    return count


@dataclass(frozen=True, slots=True)
class Served:
    """What one request did to the pool: its leading cache hit, the keys it stored and evicted."""

    cached_blocks: int
    stored: list[int]
    evicted: list[int]


class BlockPool:
    """vLLM's KV block pool: the one model of which blocks stay resident and which are evicted.

    The simulated engine drives it step by step (take the hit, allocate, register computed blocks,
    release); the knowledge tree's capacity model and the ordering benchmark run each prompt through
    it in one go (:meth:`serve`). The rules are vLLM v1's:

    - only full blocks are cached, each under its chained content key (:func:`chain_block_keys`);
    - a block referenced by a running request is in use and cannot be evicted;
    - a request frees its blocks tail first onto the end of an LRU free list, so under pressure a
      prompt loses its last blocks before its first ones;
    - allocation pops blocks from the head of the free list and evicts the keys they held: blocks
      never used go first, then the least recently freed. A freed block stays cached (reusable)
      until then.

    Block IDs are positions in the pool. ``capacity_blocks=None`` is an unlimited pool: allocation
    never evicts.
    """

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks <= 0:
            raise InvalidInputError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        blocks = capacity_blocks or 0
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(blocks))
        self._refs = [0] * blocks
        self._key_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}

    def __contains__(self, key: int) -> bool:
        return key in self._block_of

    def __len__(self) -> int:
        """Blocks whose KV is resident and reusable (in use or not yet evicted)."""
        return len(self._block_of)

    @property
    def in_use(self) -> int:
        """Blocks referenced by running requests."""
        return len(self._refs) - len(self._free)

    def leading_cached(self, keys: Sequence[int]) -> int:
        """How many of ``keys``, from the first, are cached: the engine's prefix hit in blocks."""
        return count_leading(keys, self._block_of)

    def can_take(self, hit_keys: Sequence[int], new_blocks: int) -> bool:
        """Whether ``hit_keys`` (cached) can be reused and ``new_blocks`` allocated together."""
        if self.capacity_blocks is None:
            return True
        revived = sum(1 for key in hit_keys if self._block_of[key] in self._free)
        return revived + new_blocks <= len(self._free)

    def take_cached(self, keys: Sequence[int]) -> list[int]:
        """Reference the blocks of cached ``keys`` for a request: they are in use until released."""
        blocks = [self._block_of[key] for key in keys]
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        return blocks

    def allocate(self, count: int) -> tuple[list[int], list[int]]:
        """``count`` blocks for a request, and the keys their allocation evicted."""
        if self.capacity_blocks is None:
            blocks = list(range(len(self._refs), len(self._refs) + count))
            self._refs.extend([1] * count)
            return blocks, []
        blocks = [self._free.popitem(last=False)[0] for _ in range(count)]
        evicted = [self._forget(block) for block in blocks if block in self._key_of]
        for block in blocks:
            self._refs[block] = 1
        return blocks, evicted

    def register(self, block: int, key: int) -> bool:
        """Cache a just-computed full block under ``key``; False if the key is already cached
        (computed twice at once: the first copy stays the cached one, as in vLLM)."""
        if key in self._block_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def release(self, blocks: Sequence[int]) -> None:
        """Free a request's blocks tail first, so its last blocks are evicted before its first."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    def clear(self) -> bool:
        """Forget every cached key; like vLLM's reset, refused (False) while blocks are in use."""
        if self.in_use:
            return False
        self._key_of.clear()
        self._block_of.clear()
        return True

    def serve(self, keys: Sequence[int]) -> Served:
        """Run one request start to finish: reuse its leading cached blocks, compute and cache the
        rest, free them all.

        A prompt with more blocks than the pool can give it keeps its first ones; the blocks past
        that are computed and evicted at once (so they are in both ``stored`` and ``evicted``).
        vLLM never admits such a prompt, but a pool sized from a trace (the ordering benchmark's
        10 %) can be smaller than one prompt.
        """
        hit = self.leading_cached(keys)
        blocks = self.take_cached(keys[:hit])
        room = len(self._free) if self.capacity_blocks is not None else len(keys)
        kept = keys[hit : hit + room]
        new_blocks, evicted = self.allocate(len(kept))
        stored = [key for block, key in zip(new_blocks, kept, strict=True) if self.register(block, key)]
        self.release(blocks + new_blocks)
        overflow = list(keys[hit + len(kept) :])
        return Served(hit, stored + overflow, evicted + overflow[::-1])

    def _forget(self, block: int) -> int:
        key = self._key_of.pop(block)
        del self._block_of[key]
        return key


@dataclass(slots=True)
class ResidencyCounts:
    """What the event stream did that a naive mirror gets wrong, since the mirror was made.

    ``duplicate_copies``: a BlockStored of a hash already resident (vLLM keeps one physical copy
    per request that computed the block at the same time); ``unknown_removals``: a BlockRemoved of
    a hash the mirror never saw stored (history before it listened, or a lost batch);
    ``expired_predictions``: first-token predictions no event confirmed in time.
    """

    duplicate_copies: int = 0
    unknown_removals: int = 0
    expired_predictions: int = 0


CopyKey = tuple[int | None, str | None, BlockHash]
"""Where one engine hash is resident: (KV-cache group, medium, hash)."""


class BlockResidency:
    """Which engine hashes the engine holds, counted per copy, and their content keys.

    vLLM does not de-duplicate blocks computed by requests running together: it publishes one
    BlockStored per physical copy and one BlockRemoved per freed copy. So a hash is resident, per
    (KV-cache group, medium), while its stored-copy count is above zero; the first removal of two
    copies leaves it resident. Each resident hash gives its content key one reference (a content
    key may be resident under several hashes: two groups, two media).

    Predictions (:meth:`expect`) made at a request's first token count as stored until a
    BlockStored confirms them, for at most ``prediction_ttl_s`` and at most ``max_predictions``
    at once (the oldest go first): a prediction no event confirms (a request that ran under
    another cache salt, an engine that dropped the blocks) cannot outlive that bound.

    The copy counts are bounded by the engine's own pool while the event stream is complete; the
    owner (the KV mirror) notices when it is not and resets.
    """

    def __init__(
        self,
        block_size: int,
        on_change: Callable[[int, bool], None],
        *,
        prediction_ttl_s: float = 10.0,
        max_predictions: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if prediction_ttl_s <= 0 or max_predictions <= 0:
            raise InvalidInputError("prediction_ttl_s and max_predictions must be positive")
        self.block_size = block_size
        self._on_change = on_change
        self._prediction_ttl_s = prediction_ttl_s
        self._max_predictions = max_predictions
        self._clock = clock
        self._refs: dict[int, int] = {}
        self._copies: dict[CopyKey, int] = {}
        self._key_of: dict[CopyKey, int | None] = {}  # None: a chain that started before we listened
        self._predicted: OrderedDict[int, float] = OrderedDict()  # key -> deadline, oldest first
        self.counts = ResidencyCounts()

    def __len__(self) -> int:
        return len(self._refs)

    def is_stored(self, key: int) -> bool:
        return key in self._refs

    @property
    def stored(self) -> Container[int]:
        """The stored keys, live (for membership tests on a hot path without a call per key)."""
        return self._refs.keys()

    def resident_hashes(self) -> set[CopyKey]:
        """Every (group, medium, engine hash) with at least one stored copy: what the engine's
        block pool caches, while the event stream is complete."""
        return set(self._copies)

    @property
    def predictions(self) -> int:
        """First-token predictions not confirmed yet."""
        return len(self._predicted)

    def leading_stored(self, keys: Sequence[int]) -> int:
        """How many of ``keys``, from the first, are stored."""
        return count_leading(keys, self._refs)

    def store(self, key: int) -> None:
        refs = self._refs.get(key, 0)
        self._refs[key] = refs + 1
        if refs == 0:
            self._on_change(key, True)

    def remove(self, key: int) -> None:
        refs = self._refs.get(key, 0)
        if refs > 1:
            self._refs[key] = refs - 1
        elif refs == 1:
            del self._refs[key]
            self._on_change(key, False)

    def expect(self, key: int) -> None:
        """The engine has just computed this block (its request reached its first token): count it
        stored now, before its BlockStored event arrives; that event then confirms it rather than
        adding a second reference. Events lag the request's output by a few milliseconds, and a
        request submitted in between (a queued one takes the slot the first token freed) would
        otherwise be predicted against a cache that no longer exists.
        """
        self.expire_predictions()
        if key in self._predicted:
            self._predicted[key] = self._clock() + self._prediction_ttl_s
            self._predicted.move_to_end(key)
            return
        if key in self._refs:
            return  # confirmed already
        self._predicted[key] = self._clock() + self._prediction_ttl_s
        self.store(key)
        while len(self._predicted) > self._max_predictions:
            self._drop_prediction(next(iter(self._predicted)))

    def expire_predictions(self) -> None:
        """Drop the predictions past their deadline (cheap when none is)."""
        if not self._predicted:
            return
        now = self._clock()
        while self._predicted and next(iter(self._predicted.values())) <= now:
            self._drop_prediction(next(iter(self._predicted)))

    def clear(self) -> None:
        """Forget everything without callbacks: the caller resets what depended on it."""
        self._refs.clear()
        self._copies.clear()
        self._key_of.clear()
        self._predicted.clear()

    def check(self, event: BlockStored | BlockRemoved) -> None:
        """Raise :class:`InvalidInputError` if ``event`` cannot be applied: called for a whole batch
        before any of it is, so that a bad event never leaves the batch half-applied."""
        if not isinstance(event, BlockStored):
            return
        if event.block_size != self.block_size:
            raise InvalidInputError(
                f"engine block size {event.block_size} differs from the tree's {self.block_size}"
            )
        if len(event.token_ids) != event.block_size * len(event.block_hashes):
            raise InvalidInputError("BlockStored carries a token count that is not block_size per block")

    def apply(self, event: BlockStored | BlockRemoved) -> None:
        """Apply one checked engine event (a full reset is the owner's job: it resets more)."""
        if isinstance(event, BlockStored):
            self._apply_stored(event)
            return
        for block_hash in event.block_hashes:
            where = (event.group_idx, event.medium, block_hash)
            copies = self._copies.get(where)
            if copies is None:
                self.counts.unknown_removals += 1
            elif copies > 1:
                self._copies[where] = copies - 1
            else:
                del self._copies[where]
                key = self._key_of.pop(where)
                if key is not None:
                    self.remove(key)

    def _apply_stored(self, event: BlockStored) -> None:
        keys: Sequence[int | None]
        if event.parent_block_hash is None:
            parent: int | None = ROOT_KEY if event.cache_salt is None else salted_root(event.cache_salt)
        else:
            parent = self._key_of.get((event.group_idx, event.medium, event.parent_block_hash))
        if parent is None:
            keys = [None] * len(event.block_hashes)  # the chain started before we listened
        else:
            keys = chain_block_keys(event.token_ids, event.block_size, parent)
        for block_hash, key in zip(event.block_hashes, keys, strict=True):
            where = (event.group_idx, event.medium, block_hash)
            copies = self._copies.get(where, 0)
            self._copies[where] = copies + 1
            if copies:
                self.counts.duplicate_copies += 1
                continue
            self._key_of[where] = key
            if key is not None:
                self.store(key)
                if key in self._predicted:  # confirmed: its prediction's reference goes
                    del self._predicted[key]
                    self.remove(key)

    def _drop_prediction(self, key: int) -> None:
        del self._predicted[key]
        self.counts.expired_predictions += 1
        self.remove(key)
