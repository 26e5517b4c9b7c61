"""End-to-end RAG latency: the paper's comparisons on the real engine, in one run.

Rerun: ``.venv/bin/python -m bench.e2e --quick`` or without ``--quick`` (the times of both, and
how they grow on a CPU without native bfloat16, are in docs/benchmarks.md). Arrivals come at a
share of the measured cold capacity, so every configuration's wall time grows with the engine's
prefill time: ``--quick`` therefore runs only the headline comparison, serial against ``all``
with serial again as the A/A yardstick, on two traces of 8 requests (4 blocks of 4 for each
interval, so its intervals are wider than the full run's 16 blocks); the full run keeps every
configuration, sweep and 32 requests a trace.
``--model DIR`` runs it on any Hugging Face model directory; ``--trace FILE`` replays a saved
trace (``--save-trace FILE`` writes the generated one). Output: bench/out/e2e.json (every
per-request timeline), e2e_ttft_cdf.png, e2e_ratio_sweep.png, e2e_timelines.png, a table on the
terminal and, as the last line, a JSON summary.

Fair set-up: the engine's model worker and the vector search are pinned to different cores
(``--engine-cpus``, ``--search-cpus``); one untimed pass warms up the engine first; every
configuration starts from an empty prefix cache (confirmed by the engine, see
:mod:`bench.e2e.runner`) and replays the same trace; the main configurations replay two traces
(repetitions), the second in the reverse order of the first, so steady drift of the engine is not
charged to one side (:func:`~bench.e2e.plan.run_order`), and the order run is recorded. Serial runs twice, at
both ends of the main configurations' list (``serial-repeat``): its ratio in the headline is what
drift and noise alone make of two identical runs, the yardstick for the other ratios. Headline
ratios come with 95 % bootstrap intervals over blocks of consecutive requests of each trace, not
over single requests of one queueing trace; failed requests are counted per configuration beside
its figures.
"""

from __future__ import annotations

from bench.common import plot_path, print_summary, run_measurement
from bench.e2e.measure import run
from bench.e2e.options import parse_args
from bench.e2e.report import print_table, summary_line


def main() -> None:
    args = parse_args()
    result = run_measurement(run(args))
    print_table(result)
    print(f"wrote {plot_path('e2e_ttft_cdf').parent}/e2e.json and e2e_*.png")
    print_summary(summary_line(result))


if __name__ == "__main__":
    main()
