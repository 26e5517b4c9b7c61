"""The myopic oracle: the best prefix for each request over all its orders. A yardstick for the
ordering benchmark and the tests, exponential in the worst case: not a policy a service offers.
"""

from __future__ import annotations

from collections.abc import Sequence

from specrag.cache.layout import DocId
from specrag.cache.ordering import Ordering, Probe, by_affinity, check_distinct
from specrag.cache.tree import KnowledgeTree, PrefixMatch


class MyopicOracleOrder:
    """The best prefix for *this* request over all orders, scored by ``probe`` (default: the tree).

    Exhaustive over the request's orders, skipping only extensions of a prefix whose last
    document is not fully cached (the engine's chained blocks stop there, so no extension reuses
    more). It is myopic, not an upper bound: it maximises what the current request reuses and then
    shares ``exact``'s tail, so it knows nothing that helps later requests; an order that gives up
    a little now for more sharing later (``batch``, a window over waiting requests) can beat it
    over a trace. Exponential in the worst case; meant for tests and benchmarks, not for serving.
    """

    name = "myopic-oracle"

    def __init__(self, probe: Probe | None = None) -> None:
        self._probe = probe

    def order(self, tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> Ordering:
        check_distinct(doc_ids)
        probe = self._probe or tree.cached_prefix
        best: list[tuple[PrefixMatch, tuple[DocId, ...]]] = [(probe(()), ())]  # by (tokens, docs)

        def visit(prefix: tuple[DocId, ...], remaining: list[DocId]) -> None:
            for i, doc_id in enumerate(remaining):
                extended = (*prefix, doc_id)
                match = probe(extended)
                if (match.tokens, match.docs) > (best[0][0].tokens, best[0][0].docs):
                    best[0] = (match, extended)
                if match.unbroken:
                    visit(extended, remaining[:i] + remaining[i + 1 :])

        visit((), list(doc_ids))
        prefix = best[0][1]
        chosen = set(prefix)
        rest = [d for d in doc_ids if d not in chosen]
        ordered = (*prefix, *by_affinity(tree, doc_ids, rest))
        return Ordering(ordered, probe(ordered))
