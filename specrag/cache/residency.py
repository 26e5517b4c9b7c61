"""Which KV blocks the engine holds, keyed by their chained token content.

vLLM's APC hashes every full block together with its parent's hash, so a block is reusable only
behind the exact same prefix. Its published hashes cannot be recomputed here (they are seeded
inside the engine), but a BlockStored event carries the tokens and the parent hash, so every
block gets a *content key* chained the same way: key = hash(parent key, block tokens). The
knowledge tree computes the same keys from the prompts it served, which links engine blocks to
tree nodes without ever seeing an engine hash in a prompt.

When the engine publishes no events, :class:`BlockLRU` models its cache instead: a fixed number
of blocks, least recently used evicted first, the last block of a prompt before its first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Sequence

from specrag.cache.events import BlockHash, BlockRemoved, BlockStored
from specrag.errors import InvalidInputError

ROOT_KEY = 0
"""Parent key of a prompt's first block (vLLM's ``parent_block_hash=None``)."""


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


class BlockLRU:
    """A block pool with vLLM's eviction order, for when the engine's own events are unavailable.

    vLLM frees a finished request's blocks tail first into an LRU free list, so under pressure a
    prompt loses its last blocks before its first ones; touching the keys in reverse reproduces
    that. ``capacity_blocks=None`` is an unlimited cache.
    """

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks <= 0:
            raise InvalidInputError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def leading_cached(self, keys: Sequence[int]) -> int:
        """How many of ``keys``, from the first, are cached: the engine's prefix hit in blocks."""
        return count_leading(keys, self._blocks)

    def touch(self, keys: Sequence[int]) -> tuple[list[int], list[int]]:
        """Serve a prompt's blocks; return (newly stored keys, evicted keys)."""
        added: list[int] = []
        for key in reversed(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)
            else:
                self._blocks[key] = None
                added.append(key)
        added.reverse()
        evicted: list[int] = []
        if self.capacity_blocks is not None:
            while len(self._blocks) > self.capacity_blocks:
                evicted.append(self._blocks.popitem(last=False)[0])
        return added, evicted

    def clear(self) -> None:
        self._blocks.clear()


class BlockResidency:
    """Stored content keys, translated from engine hashes, with a callback on every change.

    A content key may be stored under several engine hashes (e.g. on two media), hence the
    reference count. At most ``max_blocks`` engine hashes are remembered; past that the oldest
    are forgotten (as if evicted), which can only make the mirror under-estimate reuse.
    """

    def __init__(
        self, block_size: int, on_change: Callable[[int, bool], None], max_blocks: int = 1 << 20
    ) -> None:
        self.block_size = block_size
        self._on_change = on_change
        self._max_blocks = max_blocks
        self._refs: dict[int, int] = {}
        self._by_hash: dict[BlockHash, int] = {}

    def __len__(self) -> int:
        return len(self._refs)

    def is_stored(self, key: int) -> bool:
        return key in self._refs

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

    def clear(self) -> None:
        """Forget everything without callbacks: the caller resets what depended on it."""
        self._refs.clear()
        self._by_hash.clear()

    def apply(self, event: BlockStored | BlockRemoved) -> None:
        """Apply one engine event (a full reset is the owner's job: it resets more than this)."""
        if isinstance(event, BlockStored):
            self._apply_stored(event)
            return
        for block_hash in event.block_hashes:
            key = self._by_hash.pop(block_hash, None)
            if key is not None:
                self.remove(key)

    def _apply_stored(self, event: BlockStored) -> None:
        if event.block_size != self.block_size:
            raise InvalidInputError(
                f"engine block size {event.block_size} differs from the tree's {self.block_size}"
            )
        if len(event.token_ids) != event.block_size * len(event.block_hashes):
            raise InvalidInputError("BlockStored carries a token count that is not block_size per block")
        if event.parent_block_hash is None:
            parent = ROOT_KEY
        else:
            known = self._by_hash.get(event.parent_block_hash)
            if known is None:
                return  # the chain started before we listened: its content cannot be keyed
            parent = known
        keys = chain_block_keys(event.token_ids, event.block_size, parent)
        for block_hash, key in zip(event.block_hashes, keys, strict=True):
            if block_hash in self._by_hash:
                continue
            self._by_hash[block_hash] = key
            self.store(key)
        while len(self._by_hash) > self._max_blocks:
            oldest = next(iter(self._by_hash))
            self.remove(self._by_hash.pop(oldest))
