"""One idle point of ``bench.pipeline`` (serial and all only), measured by any commit's own code.

Bisecting overlap across commits needs the same point measured by each commit's own
``bench.pipeline``, whose options changed over time (``--targets`` came late). This script narrows
whichever ``bench.pipeline`` is first on ``PYTHONPATH`` to one point (the probe share and k given
here, or the point nearest ``--ratio``), the ``serial`` and ``all`` configurations, no loaded run,
no HNSW or flat point, and prints ``all``'s figures there as its last line (JSON). Run it from the
checkout to measure, with a data directory of that checkout's index format::

    git worktree add ../old COMMIT
    cd ../old && SPECRAG_DATA_DIR=../data-old PYTHONPATH=. \\
        ../main/.venv/bin/python ../main/bench/pipeline/point_at_commit.py --share 0.5 -k 1 --idle-queries 32

Options after the script's own go to ``bench.pipeline`` (``--idle-queries``, ``--seed``, ...).
docs/pipelining.md ("the check of 2026-11-28") has the bisect it ran.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any


def checkout_modules() -> list[Any]:
    """The checkout's bench.pipeline, not necessarily this tree's, first its command: a module
    before bench/ was split by family, the package's ``__main__`` after, and since that was split
    too, with the modules it imports (calibration, points, analysis, report)."""
    try:
        command = importlib.import_module("bench.pipeline.__main__")
    except ModuleNotFoundError:  # bench.pipeline is a module there, not a package
        command = importlib.import_module("bench.pipeline")
    others = [module for name, module in sorted(sys.modules.items()) if name.startswith("bench.pipeline.")]
    return [command, *(module for module in others if module is not command)]


MODULES = checkout_modules()
PIPELINE = MODULES[0]


def held(name: str) -> Any:
    """What the checkout's modules call ``name``, wherever it is defined."""
    return next(getattr(module, name) for module in MODULES if hasattr(module, name))


def replace_everywhere(name: str, value: Any) -> None:
    """``name`` replaced in every module of the checkout that holds it (defines or imports it)."""
    for module in MODULES:
        if hasattr(module, name):
            setattr(module, name, value)


CONFIGURATIONS = ("serial", "all")
FIGURES = (
    "ratio",
    "overlap_fraction",
    "non_overlapped_over_search",
    "serial_ttft_ms",
    "config_ttft_ms",
    "bound_ttft_ms",
    "search_ms",
    "prefill_ms",
)


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="bench/pipeline/point_at_commit.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--share", type=float, help="share of the IVF lists probed (one of the calibration's)"
    )
    parser.add_argument("-k", type=int, help="passages per prompt (with --share)")
    parser.add_argument("--ratio", type=float, default=1.0, help="without --share: the point nearest this r")
    return parser.parse_known_args()


def narrowed(args: argparse.Namespace) -> None:
    """Replace the sweep's choices in the checkout's modules: one point, two configurations."""
    every = held("configurations")

    def configurations(search_share: float) -> list[Any]:
        return [c for c in every(search_share) if c.name in CONFIGURATIONS]

    def sweep_points(search_ms: dict[float, float], prefill_ms: dict[int, float], *_: Any) -> list[Any]:
        if args.share is None or args.k is None:
            return [held("nearest_point")("ivf", search_ms, prefill_ms, args.ratio)]
        share, k = args.share, args.k
        return [
            held("Point")("ivf", share, k, search_ms[share] / prefill_ms[k], search_ms[share], prefill_ms[k])
        ]

    async def no_loaded_run(*_: Any, **__: Any) -> tuple[None, dict[str, Any]]:
        return None, {}

    replace_everywhere("configurations", configurations)
    replace_everywhere("sweep_points", sweep_points)
    replace_everywhere("loaded_run", no_loaded_run)
    replace_everywhere("plot", lambda *_, **__: None)
    replace_everywhere("headline", figures)


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """``all``'s figures at the point, and the phases where the checkout records them."""
    point = result["idle"][0]
    row = point["configurations"]["all"]
    line: dict[str, Any] = {name: round(row[name], 3) for name in FIGURES}
    if "phases" in point:
        line["phases"] = {
            name: {
                phase: (v or {}).get("median")
                for phase, v in point["phases"][name].items()
                if phase.endswith("_ms")
            }
            for name in CONFIGURATIONS
        }
    return line


def main() -> None:
    args, rest = parse_args()
    narrowed(args)
    sys.argv = ["bench.pipeline", "--quick", "--hnsw-size", "0", "--flat-size", "0", *rest]
    PIPELINE.main()


if __name__ == "__main__":  # vLLM's engine core is spawned: it imports this module again
    main()
