"""Which configurations a bench.e2e run replays, and in which order on each trace."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from bench.e2e.runner import Configuration
from specrag.controller.modes import MODE_NAMES, get_mode

RATIOS = (0.125, 0.25, 0.5, 1.0)


# The speculating modes again with every speculation launched unpriced (``speculation="always"``,
# the behaviour before the speculation policy), beside their default ``auto``.
ALWAYS = tuple(f"{mode}-always" for mode in MODE_NAMES if get_mode(mode).speculation)
ALWAYS_OVERRIDES = {"speculation": "always"}
SERIAL_REPEAT = "serial-repeat"
# What --quick still answers: does the whole system beat serial end to end, beyond what two
# identical serial runs differ by? Every configuration's time grows with the engine's prefill (the
# arrival rate follows it), so on a float32 engine a quick run can afford about six of them.
QUICK_MODES = ("serial", "all")


def configurations(args: argparse.Namespace) -> list[Configuration]:
    """Every configuration of the run; under ``--quick`` only :data:`QUICK_MODES` and the A/A."""
    modes = QUICK_MODES if args.quick else MODE_NAMES
    main = [Configuration(mode, mode, "main", args.ratio) for mode in modes]
    if not args.quick:
        main += [
            Configuration(
                name, get_mode(name.removesuffix("-always")).name, "main", args.ratio, ALWAYS_OVERRIDES
            )
            for name in ALWAYS
        ]
    # Serial once more after the others: its ratio to the first serial run is what the engine's
    # drift and the trace's noise alone make of "no difference" (an A/A comparison).
    main.append(Configuration(SERIAL_REPEAT, "serial", "main", args.ratio))
    if args.quick:
        return main
    # "exact" is the main "ordering" configuration and "retrieval" order is "serial".
    ordering = [
        Configuration(f"ordering-{p}", "ordering", "ordering", args.ratio, {"ordering_policy": p})
        for p in ("sorted", "greedy", "recency")
    ]
    prefill_bs = [
        Configuration(f"all-mpbs{b}", "all", "max_prefill_bs", args.ratio, {"max_prefill_bs": b})
        for b in (2, 4, 8)
    ]
    stages = [Configuration(f"all-stages{s}", "all", "stages", args.ratio, {"num_stages": s}) for s in (2, 8)]
    ratios = [
        Configuration(f"{mode}-ratio{int(r * 1000) / 10:g}", mode, "ratio", r)
        for r in RATIOS
        if r != args.ratio
        for mode in ("serial", "all")
    ]
    return main + ordering + prefill_bs + stages + ratios


def run_order(configurations: Sequence[Configuration], traces: int) -> list[tuple[int, Configuration]]:
    """Every configuration on trace 0, the main ones on the others, in counterbalanced orders.

    An odd trace runs its list backwards (an ABBA design): over each pair of traces every main
    configuration's mean place in the run is the same, so an engine that drifts steadily (warming,
    slowing) shifts every configuration alike and no ratio to serial carries it. Each further pair
    starts one place further along the list, so no configuration always runs first or last.
    """
    plan = []
    for seed in range(traces):
        chosen = [c for c in configurations if seed == 0 or c.group == "main"]
        shift = (seed // 2) % len(chosen)
        rotated = chosen[shift:] + chosen[:shift]
        plan += [(seed, c) for c in (rotated[::-1] if seed % 2 else rotated)]
    return plan
