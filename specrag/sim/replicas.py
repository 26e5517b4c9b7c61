"""Replicas on the simulated engine, for tests and large simulations (``bench.scale``).

Apart from :mod:`specrag.controller.replicas` so that the router's own modules never import the
simulator: a served pool's replicas are real engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specrag.cache.tree import KnowledgeTree
from specrag.controller.replicas import Replica
from specrag.sim.engine import SimulatedEngine

__all__ = ["simulated_replica"]


def simulated_replica(
    name: str, system_token_ids: Sequence[int], block_size: int = 32, **engine_options: Any
) -> Replica:
    """A simulated engine whose KV events feed a fresh tree."""
    tree = KnowledgeTree(system_token_ids, block_size=block_size)
    engine = SimulatedEngine(block_size=block_size, on_kv_events=tree.apply_events, **engine_options)
    return Replica(name, engine, tree)
