"""Ordering benchmark: prefix reuse of every ordering policy on document-ID traces.

The engine is simulated at block granularity the way vLLM's APC works: a prompt's full blocks
are keyed by chained content, a request reuses its leading cached blocks, and the pool is
either unlimited or an LRU of 10 % of the blocks the trace would store without any reuse. The
simulated engine publishes BlockStored / BlockRemoved events and the knowledge tree follows
them, exactly as it follows vLLM's. Prompts are laid out as the service lays them out
(``specrag.pipeline.store.prompt``): 32-token KV blocks, the system prompt and every document padded to
a block multiple. Documents get deterministic synthetic tokens (24-199 before padding, as this
benchmark always used, so that overhead figures compare across versions; the default corpus'
passages are longer, ~240), generated already padded so that the simulated engine's
ground-truth probe, which concatenates documents, sees exactly what ``build_layout`` produces.

Every policy runs twice, its tree mirroring an unlimited cache and the bounded one. Reported per
trace, cache and policy: its own accounting (document slots and prompt tokens served from the
simulated cache), the *independent* score of the order it ran (``bench.ordering.score``: a slot
counts when its whole prefix was served before, unlimited and with an LRU of 10 % of the slots),
the per-request cost of ordering + prompt layout (µs, p50/p99) and, for ``exact``, how many
requests the myopic oracle (every order of the request, scored on the simulated engine itself)
beat it on for that request's own reuse. ``batch`` plans the whole trace offline; ``batch-arrival``
uses the plan's document orders but the arrival order of requests; ``window`` replays the trace at
its arrival times through one prefill slot (``bench.ordering.replay``), choosing request and
document order together over the waiting requests.

    python -m bench.ordering [--quick]                       # side-by-side, JSON + PNG in bench/out/
    python -m bench.ordering --trace IN.jsonl --policy exact --emit OUT.jsonl
    python -m bench.ordering --trace IN.jsonl --policy window --window 16 --emit OUT.jsonl
    python -m bench.ordering --trace IN.jsonl --policy window --window 500ms --rate 1.0
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from bench.common import print_summary, write_json
from bench.ordering.options import parse_args
from bench.ordering.report import plot
from bench.ordering.runs import BENCH_POLICIES, emit_mode, full_benchmark
from specrag.errors import InvalidInputError


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.trace is None:
            if args.policy or args.emit:
                raise InvalidInputError("--policy and --emit need --trace")
            start = time.perf_counter()
            report = full_benchmark(args.quick)
            report["wall_s"] = time.perf_counter() - start
            json_path = write_json("ordering", report)
            summary = {"json": str(json_path), "png": str(plot(report)), "wall_s": report["wall_s"]}
        else:
            if args.policy not in BENCH_POLICIES:
                raise InvalidInputError(f"unknown policy {args.policy!r}; known: {', '.join(BENCH_POLICIES)}")
            summary = emit_mode(args)
    except (InvalidInputError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
