"""RetriedFlight, the one retry policy of the controller's answers and bench.scale's replays.

On simulated replicas: a failure before the first token is resubmitted on another replica (the
failed one excluded), a failure after it migrates the answer there (the prompt plus the tokens
already sent, max_tokens and stop strings kept), the retries are bounded, and with no engine in
service the caller gets a 503-type error instead of waiting.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from specrag.controller.flight import Flight, RetriedFlight, _spanning_stop
from specrag.controller.placement import Placed, Placement
from specrag.controller.replicas import Replica
from specrag.errors import EngineError, EngineUnavailableError
from specrag.pipeline.engines.protocol import EngineOutput
from tests.helpers.flights import Launcher, close, collect, pool, prompt, simulated


async def test_a_failure_before_the_first_token_is_resubmitted_on_another_replica() -> None:
    replicas = pool(2)
    placement = Placement(replicas, router="round_robin")
    launcher = Launcher()
    placed = placement.place_prompt(prompt())
    simulated(placed.replica).fail_next()
    answer = RetriedFlight(
        launcher.launch(placed), placement, 5.0, launcher.resubmit, inter_token_timeout_s=5.0
    )
    outputs = await collect(answer)
    (other,) = [r for r in replicas if r is not placed.replica]
    assert launcher.resubmitted == [(placed.replica.name, other.name)]
    assert answer.flight.replica is other and outputs[-1].finished
    assert placed.replica.excluded is not None and other.excluded is None
    await close(replicas)


def two_replicas_answering(max_tokens: int) -> tuple[list[Replica], Placed, Launcher, Flight, RetriedFlight]:
    """Two replicas, a prompt placed on one, and its answer (the first flight) under RetriedFlight."""
    replicas = pool(2)
    placement = Placement(replicas)
    launcher = Launcher(max_tokens=max_tokens)
    placed = placement.place_prompt(prompt())
    first = launcher.launch(placed)
    return (
        replicas,
        placed,
        launcher,
        first,
        RetriedFlight(first, placement, 5.0, launcher.resubmit, inter_token_timeout_s=5.0),
    )


async def test_a_failure_after_the_first_token_migrates_the_answer_and_the_stream_goes_on() -> None:
    replicas, placed, launcher, first, answer = two_replicas_answering(max_tokens=400)
    outputs = []
    async for output in answer.outputs():
        outputs.append(output)
        if len(outputs) == 2:
            await simulated(placed.replica).die()
    await answer.flight.abort()
    (other,) = [r for r in replicas if r is not placed.replica]
    assert launcher.resubmitted == [(placed.replica.name, other.name)]
    (sent,) = launcher.sent
    before = [
        token for output in outputs if output.request_id == first.request_id for token in output.token_ids
    ]
    assert list(sent) == before and sent  # it continued from exactly what the caller had
    assert answer.flight.prompt_token_ids == (*placed.layout.token_ids, *sent)
    # One whole stream: every token up to max_tokens, then the end.
    assert sum(len(output.token_ids) for output in outputs) == 400
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert placed.replica.excluded is not None
    await close(replicas)


async def test_an_answer_lost_with_only_its_end_missing_ends_without_a_new_request() -> None:
    replicas, _, launcher, flight, answer = two_replicas_answering(max_tokens=2)
    tokens: list[int] = []
    reasons = []
    with pytest.MonkeyPatch.context() as patch:  # the engine dies right after the last token
        original = flight.outputs

        async def cut(timeout_s: float, inter_token_timeout_s: float) -> AsyncIterator[EngineOutput]:
            async for output in original(timeout_s, inter_token_timeout_s):
                yield replace(output, finished=False, finish_reason=None)
                if len(tokens) >= 2:  # the consumer has every token
                    raise EngineError("died after the last token")

        patch.setattr(flight, "outputs", cut)
        async for output in answer.outputs():
            tokens.extend(output.token_ids)
            reasons.append(output.finish_reason)
    await answer.flight.abort()
    assert len(tokens) == 2 and reasons[-1] == "length" and launcher.resubmitted == []
    await close(replicas)


@pytest.mark.parametrize(
    ("text", "moved_at", "new", "cut"),
    [
        (" t1 t2 en", 9, "d t3", 0),  # "end" began before the move: nothing more is said
        (" t1 t2 e", 8, "nd t3", 0),
        (" t1 t2", 6, " t3 end", None),  # entirely after the move: the new engine's own stop
        (" t1 t2", 6, " t3", None),
        (" t1 st", 6, "o", None),  # "stop" not complete yet
    ],
)
def test_a_stop_string_across_the_move_is_found(text: str, moved_at: int, new: str, cut: int | None) -> None:
    assert _spanning_stop(text, moved_at, new, ("end", "stop")) == cut


async def test_retries_are_bounded_by_the_other_replicas() -> None:
    replicas = pool(2)
    placement = Placement(replicas)
    launcher = Launcher()
    for replica in replicas:
        simulated(replica).fail_next(1, EngineError("injected"))
    placed = placement.place_prompt(prompt())
    answer = RetriedFlight(
        launcher.launch(placed), placement, 5.0, launcher.resubmit, inter_token_timeout_s=5.0
    )
    with pytest.raises(EngineError, match="injected"):
        await collect(answer)
    assert len(launcher.resubmitted) == 1  # one other replica: one retry
    await close(replicas)


async def test_with_no_engine_in_service_the_caller_is_told_to_retry_shortly() -> None:
    replicas = pool(2)
    placement = Placement(replicas)
    launcher = Launcher()
    placed = placement.place_prompt(prompt())
    (other,) = [r for r in replicas if r is not placed.replica]
    other.exclude("down for the test")
    simulated(placed.replica).fail_next()
    answer = RetriedFlight(
        launcher.launch(placed), placement, 0.2, launcher.resubmit, inter_token_timeout_s=5.0
    )
    with pytest.raises(EngineUnavailableError, match="no engine in service"):
        await collect(answer)
    assert launcher.resubmitted == []
    await close(replicas)


async def test_a_single_replica_is_retried_once_on_itself() -> None:
    replicas = pool(1)
    placement = Placement(replicas)
    launcher = Launcher()
    simulated(replicas[0]).fail_next()
    answer = RetriedFlight(
        launcher.launch(placement.place_prompt(prompt())),
        placement,
        5.0,
        launcher.resubmit,
        inter_token_timeout_s=5.0,
    )
    assert (await collect(answer))[-1].finished
    assert launcher.resubmitted == [("r0", "r0")] and replicas[0].excluded is None
    await close(replicas)
