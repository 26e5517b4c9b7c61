"""The knowledge-tree tests' tiny engine: a set of stored content keys and vLLM-like events.

Independent of the tree under test: it only shares the content-key function, whose single job
(chaining block contents) is checked on its own in test_residency.py."""

from __future__ import annotations

from collections.abc import Sequence

from specrag.cache import BlockRemoved, BlockStored, DocId, KnowledgeTree, KVEvent, PromptLayout, build_layout
from specrag.cache.residency import chain_block_keys

BLOCK = 4
SYSTEM = (1, 2, 3, 4, 5, 6)
QUESTION_TOKENS = (9, 9, 9)


def doc_tokens(doc_id: DocId) -> tuple[int, ...]:
    """Lengths 1..11 so documents end on, before and across block boundaries (ids are integers)."""
    number = int(doc_id)
    return tuple(100 * (number + 1) + i for i in range(1 + (number * 5) % 11))


def layout(order: Sequence[DocId]) -> PromptLayout:
    return build_layout(SYSTEM, [(d, doc_tokens(d)) for d in order], QUESTION_TOKENS)


class FakeEngine:
    """Stores every full block of a served prompt; evicts only when told."""

    def __init__(self) -> None:
        self.hash_of: dict[int, int] = {}  # content key -> engine hash

    def serve(self, prompt: PromptLayout) -> list[KVEvent]:
        keys = chain_block_keys(prompt.token_ids, BLOCK)
        events: list[KVEvent] = []
        for i, key in enumerate(keys):
            if key not in self.hash_of:
                self.hash_of[key] = hash(("engine", key))
                parent = self.hash_of[keys[i - 1]] if i else None
                tokens = prompt.token_ids[i * BLOCK : (i + 1) * BLOCK]
                events.append(BlockStored((self.hash_of[key],), parent, tokens, BLOCK))
        return events

    def evict(self, keys: Sequence[int]) -> list[KVEvent]:
        hashes = tuple(self.hash_of.pop(k) for k in keys if k in self.hash_of)
        return [BlockRemoved(hashes)] if hashes else []

    def cached(self, order: Sequence[DocId]) -> tuple[int, int]:
        """Ground truth (tokens, leading whole documents) a prompt in this order would reuse.

        Blocks reaching into the question are not counted: questions differ between requests.
        """
        prompt = layout(order)
        documents_end = prompt.segments[-1].start
        blocks = 0
        for key in chain_block_keys(prompt.token_ids[:documents_end], BLOCK):
            if key not in self.hash_of:
                break
            blocks += 1
        docs = 0
        for seg in prompt.segments[1:]:
            if seg.kind != "document" or seg.end > blocks * BLOCK:
                break
            docs += 1
        return blocks * BLOCK, docs


def served_tree(
    *orders: tuple[int, ...], capacity_blocks: int | None = None
) -> tuple[KnowledgeTree, FakeEngine]:
    """A tree that followed an engine through served prompts (with a capacity: a tree without
    KV events, which models the cache instead)."""
    tree = KnowledgeTree(SYSTEM, block_size=BLOCK, capacity_blocks=capacity_blocks)
    engine = FakeEngine()
    for order in orders:
        prompt = layout(order)
        tree.record_served(prompt)
        if capacity_blocks is None:
            tree.apply_events(engine.serve(prompt))
    return tree, engine
