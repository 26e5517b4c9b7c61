"""The stand-in's prefix cache: a fixed number of KV blocks, hashed and reported as vLLM does.

Block hashes are vLLM's own (``hash_block_tokens`` chained from ``NONE_HASH``, with the hash
function of vLLM's default ``prefix_caching_hash_algo``, published as vLLM publishes them by
``maybe_convert_block_hash``), and the events are vLLM's own classes, so a subscriber cannot tell
this cache from a vLLM engine's by what it receives. What it keeps of vLLM's block pool is what
the prefix hit depends on:

- a request's hit is its leading blocks found cached, all but the block holding its last prompt
  token at most (the engine computes that token);
- blocks a running request holds are never evicted; a block nobody holds stays cached and is
  evicted least recently freed first, a request's blocks freed tail first (so a prompt's later
  blocks go before the prefix others share);
- a full block enters the cache once computed (``BlockStored``); one whose hash is already cached
  (computed by another request at the same time) is not stored twice: the request holds the
  cached copy from then on (vLLM keeps both copies, which only its counts would show);
- a reset empties it (``AllBlocksCleared``) only while no request holds a block, as vLLM's does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from vllm.distributed import kv_events as vllm_events
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import BlockHash, hash_block_tokens, init_none_hash, maybe_convert_block_hash

from specrag.errors import InvalidInputError

__all__ = ["HASH_ALGORITHM", "PrefixCache"]

HASH_ALGORITHM = "sha256"
"""vLLM's default ``prefix_caching_hash_algo``, which ``specrag engine`` leaves as it is."""

KVEvent = vllm_events.BlockStored | vllm_events.BlockRemoved | vllm_events.AllBlocksCleared


class PrefixCache:
    """``num_blocks`` blocks of ``block_size`` tokens; the events of each change wait in a queue
    (:meth:`take_events`) for the engine step that publishes them."""

    def __init__(self, num_blocks: int, block_size: int, hash_algorithm: str = HASH_ALGORITHM) -> None:
        if num_blocks < 1 or block_size < 1:
            raise InvalidInputError(
                f"prefix cache: blocks and block size must be at least 1, got {num_blocks} and {block_size}"
            )
        self._hash_fn = get_hash_fn_by_name(hash_algorithm)
        init_none_hash(self._hash_fn)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs: dict[BlockHash, int] = {}  # every cached block, with the requests holding it
        self._evictable: OrderedDict[BlockHash, None] = OrderedDict()  # cached, held by none; oldest first
        self._private = 0  # blocks held by requests and not cached (not full or not computed yet)
        self._events: list[KVEvent] = []
        self.hit_tokens = 0
        self.queried_tokens = 0

    @property
    def cached_blocks(self) -> int:
        return len(self._refs)

    @property
    def used_blocks(self) -> int:
        """Blocks some request holds."""
        return len(self._refs) - len(self._evictable) + self._private

    def hash_blocks(self, token_ids: Sequence[int], parent: BlockHash | None = None) -> list[BlockHash]:
        """vLLM's chained hashes of the full blocks of ``token_ids`` (which start after ``parent``)."""
        hashes: list[BlockHash] = []
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            parent = hash_block_tokens(self._hash_fn, parent, token_ids[start : start + size])
            hashes.append(parent)
        return hashes

    def leading_hits(self, hashes: Sequence[BlockHash], prompt_tokens: int) -> int:
        """The blocks of a prompt the engine would reuse: its leading cached ones, its last token's
        block never."""
        usable = min(len(hashes), (prompt_tokens - 1) // self.block_size)
        hits = 0
        while hits < usable and hashes[hits] in self._refs:
            hits += 1
        return hits

    def can_hold(self, hits: Sequence[BlockHash], new_blocks: int) -> bool:
        """Whether a request reusing ``hits`` finds ``new_blocks`` blocks (free or evictable)."""
        held_hits = sum(1 for block_hash in hits if block_hash in self._evictable)
        free = self.num_blocks - len(self._refs) - self._private
        return free + len(self._evictable) - held_hits >= new_blocks

    def acquire(self, hits: Sequence[BlockHash], new_blocks: int, prompt_tokens: int) -> None:
        """Hold ``hits`` and ``new_blocks`` fresh blocks, evicting the least recently freed (check
        :meth:`can_hold` first)."""
        for block_hash in hits:
            self._hold(block_hash)
        free = self.num_blocks - len(self._refs) - self._private
        for _ in range(new_blocks - free):
            evicted, _ = self._evictable.popitem(last=False)
            del self._refs[evicted]
            self._events.append(
                vllm_events.BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(evicted)],
                    medium=vllm_events.MEDIUM_GPU,
                    group_idx=0,
                )
            )
        self._private += new_blocks
        self.hit_tokens += len(hits) * self.block_size
        self.queried_tokens += prompt_tokens

    def commit(self, hashes: Sequence[BlockHash], parent: BlockHash | None, token_ids: Sequence[int]) -> None:
        """Held fresh blocks were computed in full: ``hashes`` (after ``parent``), whose tokens are
        ``token_ids``, enter the cache; consecutive new ones are published as one event, as vLLM
        publishes a request's blocks of one step."""
        size = self.block_size
        run: list[BlockHash] = []
        run_parent, run_start = parent, 0
        for number, block_hash in enumerate(hashes):
            self._private -= 1
            if block_hash in self._refs:  # computed beside another request: hold the cached copy
                self._hold(block_hash)
                self._store(run, run_parent, token_ids[run_start * size : (run_start + len(run)) * size])
                run, run_parent, run_start = [], block_hash, number + 1
                continue
            self._refs[block_hash] = 1
            run.append(block_hash)
        self._store(run, run_parent, token_ids[run_start * size : (run_start + len(run)) * size])

    def release(self, held: Sequence[BlockHash], fresh_blocks: int) -> None:
        """A request ended: its cached blocks (in prompt order) are freed tail first, its
        ``fresh_blocks`` never cached go back to the pool."""
        self._private -= fresh_blocks
        for block_hash in reversed(held):
            refs = self._refs[block_hash] - 1
            self._refs[block_hash] = refs
            if refs == 0:
                self._evictable[block_hash] = None

    def reset(self) -> bool:
        """Empty the cache, as vLLM's ``reset_prefix_cache``: refused while a request holds blocks."""
        if self.used_blocks:
            return False
        self._refs.clear()
        self._evictable.clear()
        self._events.append(vllm_events.AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def _hold(self, block_hash: BlockHash) -> None:
        self._refs[block_hash] += 1
        self._evictable.pop(block_hash, None)

    def _store(self, hashes: list[BlockHash], parent: BlockHash | None, token_ids: Sequence[int]) -> None:
        if not hashes:
            return
        self._events.append(
            vllm_events.BlockStored(
                block_hashes=[maybe_convert_block_hash(block_hash) for block_hash in hashes],
                parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                token_ids=list(token_ids),
                block_size=self.block_size,
                lora_id=None,
                medium=vllm_events.MEDIUM_GPU,
                lora_name=None,
                group_idx=0,
            )
        )
