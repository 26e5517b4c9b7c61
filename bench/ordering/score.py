"""Independent score of emitted document orderings: the share of document slots reused.

A request's slot ``i`` counts as reused when the whole prefix ``docs[0..i]`` was served before
(by an earlier request, in execution order) and is still held: with documents padded to KV
blocks, that is exactly when a prefix cache serves the document's KV. Two caches:

- **unlimited**: every prefix ever served is held;
- **LRU**: at most ``capacity`` prefixes (10 % of all slots of the run by default) are held, least
  recently used evicted first. Serving a request touches its prefixes from the last to the first,
  as vLLM frees a request's blocks tail first and SGLang's radix cache evicts leaves first: a
  prefix is never evicted before its own extensions, so what is held is always prefix-closed.

This module deliberately shares no accounting code with the policies or the benchmark's simulated
engine (of specrag and bench it imports only the reader of trace files): it is the check on their
own accounting.

    python -m bench.ordering.score OUT.jsonl [--trace T.jsonl] [--lru-fraction 0.1]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from pathlib import Path

from bench.traces import read_trace_lines

Order = Sequence[Hashable]
LRU_FRACTION = 0.10


def reused_slots(orders: Sequence[Order], capacity: int | None) -> int:
    """Slots whose prefix up to and including them is held when their request runs.

    ``capacity=None`` holds every prefix ever served; otherwise at most ``capacity`` prefixes.
    """
    if capacity is not None and capacity < 1:
        raise ValueError(f"the cache must hold at least one prefix, got {capacity}")
    held: OrderedDict[tuple[Hashable, ...], None] = OrderedDict()
    reused = 0
    for order in orders:
        prefixes = [tuple(order[: i + 1]) for i in range(len(order))]
        for prefix in prefixes:
            if prefix not in held:
                break
            reused += 1
        for prefix in reversed(prefixes):  # the first prefix ends up the most recently used
            held[prefix] = None
            held.move_to_end(prefix)
        while capacity is not None and len(held) > capacity:
            held.popitem(last=False)
    return reused


def lru_capacity(orders: Sequence[Order], fraction: float = LRU_FRACTION) -> int:
    """``fraction`` of all slots of the run (at least one prefix)."""
    return max(1, round(fraction * sum(len(order) for order in orders)))


def score(orders: Sequence[Order], fraction: float = LRU_FRACTION) -> dict[str, float]:
    """Reused share of all slots, unlimited and with an LRU of ``fraction`` of the slots."""
    slots = sum(len(order) for order in orders)
    if slots == 0:
        return {"unlimited": 0.0, "lru": 0.0}
    return {
        "unlimited": reused_slots(orders, None) / slots,
        "lru": reused_slots(orders, lru_capacity(orders, fraction)) / slots,
    }


def _read_orders(path: Path) -> list[dict[str, object]]:
    records = []
    for lineno, record in read_trace_lines(path):
        if not isinstance(record.get("docs"), list):
            raise ValueError(f'{path} line {lineno}: expected an object with a "docs" list')
        records.append(record)
    return records


def _key(value: object) -> str:
    return json.dumps(value)


def check_against_trace(emitted: list[dict[str, object]], trace: list[dict[str, object]]) -> None:
    """Every trace request appears exactly once, with a permutation of its documents."""
    expected = {_key(r.get("rid", i)): sorted(map(_key, r["docs"])) for i, r in enumerate(trace)}  # type: ignore[call-overload]
    seen: set[str] = set()
    for record in emitted:
        rid = _key(record.get("rid"))
        if rid not in expected or rid in seen:
            raise ValueError(f"emitted request {rid} is not in the trace or appears twice")
        if sorted(map(_key, record["docs"])) != expected[rid]:  # type: ignore[call-overload]
            raise ValueError(f"emitted request {rid} is not a permutation of its trace documents")
        seen.add(rid)
    if len(seen) != len(expected):
        raise ValueError(f"{len(expected) - len(seen)} trace requests are missing from the emitted file")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ordering.score", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("emitted", type=Path, help='JSONL of {"rid", "docs"} in execution order')
    parser.add_argument("--trace", type=Path, help="check the emitted file against this trace")
    parser.add_argument("--lru-fraction", type=float, default=LRU_FRACTION, help="LRU size over all slots")
    args = parser.parse_args(argv)
    try:
        if not 0 < args.lru_fraction <= 1:
            raise ValueError("--lru-fraction must be in (0, 1]")
        emitted = _read_orders(args.emitted)
        if args.trace is not None:
            check_against_trace(emitted, _read_orders(args.trace))
        orders = [[_key(d) for d in record["docs"]] for record in emitted]  # type: ignore[attr-defined]
        result = score(orders, args.lru_fraction)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"requests": len(orders), "slots": sum(map(len, orders)), **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
