"""What bench.faults records: each request's outcome and the run's faults, recoveries and leaks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from bench.faults.inputs import QUESTION

TOKEN = "bench-faults-token"
# The outcome of a request its client abandoned on purpose (nginx's "client closed request").
CLIENT_LEFT = 499
FIRST_TOKEN_TIMEOUT_S = 5.0
# How long a fault may take to be answered or recovered from before the run counts it as a hang.
ERROR_BOUND_S = 60.0
RECOVERY_BOUND_S = 240.0
QUESTIONS = (
    QUESTION,
    "How does asyncio.run create and close the event loop?",
    "What is a generator expression?",
    "How are exceptions chained with raise from?",
    "What does the with statement guarantee?",
    "How do I open a file for appending?",
)


@dataclass
class Outcome:
    """One request as the client saw it; ``status`` 0 means the connection broke or timed out."""

    scenario: str
    started_s: float
    latency_s: float
    status: int
    note: str = ""


@dataclass
class Run:
    """Everything measured, relative to ``t0``."""

    t0: float = field(default_factory=time.perf_counter)
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    recoveries: dict[str, float] = field(default_factory=dict)
    health_failures: int = 0
    bad_inputs: list[dict[str, Any]] = field(default_factory=list)
    overload: dict[str, Any] = field(default_factory=dict)
    leaks: dict[str, Any] = field(default_factory=dict)
    step: str = "starting the service"
    """The scenario under way: what a failure happened in."""

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def begin(self, step: str) -> None:
        self.step = step
        print(step, flush=True)
