"""Reliability of the real service under faults, overload, disconnects and bad input.

Rerun: ``.venv/bin/python -m bench.faults --quick`` (about 5 minutes here) or without ``--quick``
(longer loads, more disconnects). It starts the embedded default service (in-process vLLM,
``enforce_eager`` for a faster start) on a loopback port and, driving it over HTTP:

a. kills the vLLM engine core (SIGKILL) mid-load: every affected query must get a clear error
   (502/503/504) or be retried, the supervisor must restart the engine; recovery is the time from
   the kill to ``/health`` 200 on a new engine and a successful query;
b. stops the engine core (SIGSTOP) mid-load: queries must hit the first-token timeout (504) or
   fail fast (503) while the supervisor replaces the engine; recovery is measured the same way;
c. overloads it past ``max_queries``, ``max_queries_per_client`` and the controller's
   ``max_queue``: the excess gets 429 with Retry-After, the admitted queries' p99 is reported;
d. opens streams and drops them mid-answer or mid-wait: nothing may be left in the engine;
e. sends the catalogue of malformed requests in :mod:`bench.faults.inputs`: each must get its 4xx;
f. soaks it for a bounded time (``--soak-s``): callers back to back while others keep leaving
   mid-stream and mid-wait; afterwards no engine request may be left in any state.

A 5xx other than the documented engine errors (502 engine error, 503 engine recovering, 504 no
first token in time) counts as a server error. A leak is any engine request still running,
waiting or unfinished in the engine's own counts, or still held by the controller, after the
service settled.

Output: bench/out/faults.json, faults.png (request outcomes over time around the faults, recovery
times), a table on the terminal and, as the last line, a JSON summary. The summary is printed
whatever happens, also when a scenario fails, the engine does not come back or the run is
interrupted: ``failure`` then names the scenario and the error, ``checks`` says which checks held,
and the exit status is 0 only when every one held and nothing failed. Every engine-core process
is gone at the end, a stopped one included, even when the run fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import traceback
from typing import Any

from bench.common import stop_cleanly_on_sigterm
from bench.faults.options import parse_args
from bench.faults.outcomes import Run
from bench.faults.report import report, summarize
from bench.faults.scenarios import kill_leftover, run_all


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    run = Run()
    sys.exit(0 if report(run, run_and_name_failure(args, run), args.quick) else 1)


def run_and_name_failure(args: argparse.Namespace, run: Run) -> dict[str, Any]:
    """Run every scenario; the summary, with the failure that stopped the run (if one did)."""
    stopped: set[int] = set()
    failure = None
    try:
        stop_cleanly_on_sigterm()
        asyncio.run(run_all(args, run, stopped))
    except (Exception, KeyboardInterrupt) as error:  # said in the summary: the run must end saying it
        failure = f"{run.step}: {type(error).__name__}: {error}"
        traceback.print_exc()
    finally:
        leftover = kill_leftover(stopped)  # even on error: nothing may stay stopped or orphaned
    summary = summarize(run, leftover, failure)
    summary["wall_s"] = round(run.now(), 1)
    return summary


if __name__ == "__main__":
    main()
