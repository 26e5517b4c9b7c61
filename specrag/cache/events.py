"""The engine's KV-cache events, as plain data the knowledge tree understands.

They mirror vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` without importing
vLLM, so the cache layer stays engine-free; specrag.pipeline.kv_mirror.sequence converts vLLM's own
messages into these.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AllBlocksCleared", "BlockHash", "BlockRemoved", "BlockStored", "KVEvent"]

BlockHash = int | bytes
"""vLLM publishes 64-bit ints by default, raw digests with some hash functions."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks entered the prefix cache; ``token_ids`` holds ``block_size`` per block."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    # The prefix-cache salt of a chain's first block (parent None), when it has one: salted blocks
    # (turbo requests' loaded documents, docs/turbo.md) are another cache than unsalted ones.
    cache_salt: str | None = None
    # The KV-cache group and the storage medium holding them: a hash is resident per both.
    group_idx: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """One copy of each of these blocks left the prefix cache (another copy may stay)."""

    block_hashes: tuple[BlockHash, ...]
    group_idx: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset; nothing is resident any more."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
