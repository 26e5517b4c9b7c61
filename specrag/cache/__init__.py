"""The knowledge tree: a mirror of the engine's prefix cache that decides document order.

Owns no KV and talks to no network or engine; depends on nothing else of specrag's. The
controller orders every prompt with a policy over a :class:`KnowledgeTree`, builds it with
:func:`build_layout`, reports what was served (:meth:`KnowledgeTree.record_served`) and what the
engine evicted (:meth:`KnowledgeTree.apply_events`) and queues requests with
:class:`RatioQueue` (or chooses request and document order together over the waiting ones
with :class:`WindowScheduler`). :func:`plan_batch` orders a batch known in advance (the ordering
benchmark's offline plan).
"""

from specrag.cache.batch import BatchPlan, plan_batch
from specrag.cache.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from specrag.cache.hints import Dedup, HintConfig, order_hint
from specrag.cache.layout import DocId, PromptLayout, Segment, build_layout
from specrag.cache.ordering import POLICY_NAMES, Ordering, OrderingPolicy, get_policy
from specrag.cache.pgdsf import PrefillProfile
from specrag.cache.prefill_estimator import PrefillEstimator
from specrag.cache.prefill_queue import RatioQueue, WindowScheduler
from specrag.cache.tree import KnowledgeTree, PrefixMatch

__all__ = [
    "POLICY_NAMES",
    "AllBlocksCleared",
    "BatchPlan",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "Dedup",
    "DocId",
    "HintConfig",
    "KVEvent",
    "KnowledgeTree",
    "Ordering",
    "OrderingPolicy",
    "PrefillEstimator",
    "PrefillProfile",
    "PrefixMatch",
    "PromptLayout",
    "RatioQueue",
    "Segment",
    "WindowScheduler",
    "build_layout",
    "get_policy",
    "order_hint",
    "plan_batch",
]
