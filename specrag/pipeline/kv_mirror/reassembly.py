"""Live and replayed KV-event batches put back in order, on the subscriber's receiving thread.

A hole in the live stream is filled from vLLM's replay socket while live batches keep arriving:
they are held here (not left in ZMQ's queues, which drop past their high-water mark) until the
replay reaches them. The replay socket answers with everything it holds from the batch asked
for, the live ones included; what it sends can be dropped on its way (vLLM's ROUTER keeps ZMQ's
default high-water mark of 1,000 frames), the end marker too. So a replay:

- ends as soon as its batches meet the live ones (the rest of its answer is not read);
- waits for each next frame ``idle_s`` at most (a long history arrives at its own pace: no fixed
  total), and when it ends with a hole left, the next one asks from that hole;
- counts the hole lost only when the replay socket no longer holds it (its answer starts after
  the hole), or after ``attempts`` replays in a row that brought nothing.

Replayed batches may run ahead of the live stream; their live copies are then recognised by
their bytes, and a live batch numbered at or below one already seen that is not such a copy is
a new publisher (a restarted engine). Everything here runs on one thread, free of sockets, and
feeds an :class:`EventSequence` whose target hands each batch to the event loop
(:mod:`.handoff`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from specrag.pipeline.kv_mirror.sequence import EventSequence

__all__ = ["Downstream", "Reassembly", "ReplaySocket"]

logger = logging.getLogger(__name__)


class ReplaySocket(Protocol):
    """The replay socket, as the receiving thread drives it."""

    def ask(self, first: int) -> None:
        """Ask for every batch from ``first`` on, dropping any request still answering."""

    def drop(self) -> None:
        """Stop reading the answer to the request in flight."""


class Downstream(Protocol):
    """Where the receiving thread's results go (the event loop's side of the handoff)."""

    def stamp(self, seq: int, received_at: float) -> None:
        """Batch ``seq``, received at ``received_at``, is the next one handed on."""

    def joined(self) -> None:
        """The subscription has joined and its start-up replay ended."""

    def position(self, seq: int) -> None:
        """The sequence has passed batch ``seq`` (handed on, skipped or given up)."""


@dataclass
class _Held:
    payload: bytes
    received_at: float
    replayed: bool


@dataclass
class _Replay:
    first: int  # the batch asked from
    opening: bool  # the start-up replay from batch 0
    last_frame_at: float  # when asked, then at each frame
    frames: int = 0
    progress: bool = False  # brought a batch not held before


class Reassembly:
    """Orders the batches of one subscription and drives its replays (see the module docstring).

    ``replay=None``: no replay socket, so every hole is lost at once and the first batch received
    opens the sequence. ``known`` is the highest batch number known to exist and
    ``oldest_held_at`` when the oldest batch held for a hole was received (None: none is): read
    by the loop for the lag.
    """

    def __init__(
        self,
        sequence: EventSequence,
        downstream: Downstream,
        replay: ReplaySocket | None,
        *,
        idle_s: float,
        attempts: int,
    ) -> None:
        if idle_s <= 0 or attempts < 1:
            raise ValueError(f"a replay needs idle_s > 0 and attempts >= 1, got {idle_s}, {attempts}")
        self._sequence = sequence
        self._down = downstream
        self._socket = replay
        self._idle_s = idle_s
        self._attempts = attempts
        self._held: OrderedDict[int, _Held] = OrderedDict()  # oldest received first
        self._ahead: OrderedDict[int, bytes] = OrderedDict()  # replayed, handed on before the live copy
        self._last_live = -1
        self._replay: _Replay | None = None
        self._fruitless = 0  # replays in a row that brought nothing
        self._joined = False
        self.known = -1
        self.oldest_held_at: float | None = None

    def deadline(self) -> float | None:
        """When the replay in flight is over unless a frame comes first (None: none is)."""
        return None if self._replay is None else self._replay.last_frame_at + self._idle_s

    # ------------------------------------------------------------------ inputs

    def handshake(self, now: float) -> None:
        """The SUB socket's handshake with the publisher succeeded: ask for its history."""
        if self._socket is not None and not self._sequence.started:
            self._ask(0, now, opening=True)

    def live(self, seq: int, payload: bytes, now: float) -> None:
        sequence = self._sequence
        if self._socket is None:
            sequence.missing_before(seq)  # opens the sequence, or sees a new publisher
            sequence.give_up(seq)
            self._hand_on(seq, _Held(payload, now, replayed=False))
            self._joined_now()
            self._settled()
            return
        copy = self._ahead.get(seq)
        if copy is not None and copy == payload:  # already handed on from a replay
            self._live_reached(seq)
            self._settled()
            return
        if seq <= self._last_live or (sequence.started and seq <= sequence.last_seq):
            self._new_publisher(seq)
        self._live_reached(seq)
        self._held[seq] = _Held(payload, now, replayed=False)
        self._advance(now)

    def replayed(self, seq: int, payload: bytes, now: float) -> None:
        replay, sequence = self._replay, self._sequence
        if replay is None:
            return
        replay.last_frame_at = now
        replay.frames += 1
        if not sequence.started:
            sequence.open()  # the answer proves the join
        if replay.opening and not sequence.catch_up:
            first_live = min(self._held, default=None)
            if first_live is None or seq < first_live:  # history, not needed
                sequence.skip(seq)
                self._note_ahead(seq, payload)
        elif seq > sequence.last_seq and seq not in self._held:
            if replay.frames == 1 and seq > sequence.last_seq + 1:
                self._give_up_before(seq)  # the replay buffer no longer starts at the hole
            replay.progress = True
            self._held[seq] = _Held(payload, now, replayed=True)
        self._advance(now)

    def replay_ended(self, now: float) -> None:
        """The replay's end marker came."""
        self._replay_over(now, complete=True)

    def tick(self, now: float) -> None:
        """Time passed: a replay with no frame for ``idle_s`` is over."""
        deadline = self.deadline()
        if deadline is not None and now >= deadline:
            logger.info("a KV event replay ended without its end marker: nothing came for %s s", self._idle_s)
            self._replay_over(now, complete=False)

    # ------------------------------------------------------------------ the order

    def _advance(self, now: float) -> None:
        """Hand on what is in order; ask for the first hole, or end a replay that met the live
        batches."""
        sequence = self._sequence
        if not sequence.started:
            if self._replay is not None or not self._held:
                self._settled()
                return
            sequence.open()  # no replay answered: the first live batch opens the sequence
            if not sequence.catch_up:
                sequence.skip(min(self._held) - 1)
        while (held := self._held.pop(sequence.last_seq + 1, None)) is not None:
            self._hand_on(sequence.last_seq + 1, held)
        replay = self._replay
        if self._held:  # a hole before the batches held
            if replay is None:
                self._ask(sequence.last_seq + 1, now, opening=False)
        elif replay is not None and self._last_live >= replay.first and sequence.last_seq >= self._last_live:
            self._end_replay()  # it met the live batches: the rest of its answer is theirs
        if self._replay is None:
            self._joined_now()
        self._settled()

    def _replay_over(self, now: float, *, complete: bool) -> None:
        replay, sequence = self._replay, self._sequence
        if replay is None:
            return
        self._end_replay()
        if not sequence.started and complete:
            sequence.open()  # an empty history: the publisher published nothing yet
        self._fruitless = 0 if replay.progress or (complete and not self._held) else self._fruitless + 1
        if replay.opening and sequence.started and not sequence.catch_up and self._held:
            sequence.skip(min(self._held) - 1)  # history before the first live batch
        elif self._fruitless >= self._attempts:
            self._fruitless = 0
            if sequence.started and self._held:
                logger.warning("KV event replays from batch %d brought nothing", sequence.last_seq + 1)
                self._give_up_before(min(self._held))
        elif not sequence.started:
            self._ask(0, now, opening=True)
            self._settled()
            return
        self._advance(now)

    def _give_up_before(self, seq: int) -> None:
        """Everything missing before ``seq`` is lost (or, opening, unknown): hand on what is held
        up to it, counting each hole."""
        sequence = self._sequence
        while sequence.last_seq + 1 < seq:
            present = min((s for s in self._held if s < seq), default=seq)
            sequence.give_up(present)
            held = self._held.pop(present, None)
            if held is not None:
                self._hand_on(present, held)

    def _hand_on(self, seq: int, held: _Held) -> None:
        self._down.stamp(seq, held.received_at)
        self._sequence.deliver(seq, held.payload, replayed=held.replayed)
        if held.replayed:
            self._note_ahead(seq, held.payload)

    def _note_ahead(self, seq: int, payload: bytes) -> None:
        if seq > self._last_live:
            self._ahead[seq] = payload

    def _live_reached(self, seq: int) -> None:
        self._last_live = seq
        while self._ahead and next(iter(self._ahead)) <= seq:
            self._ahead.popitem(last=False)

    def _new_publisher(self, seq: int) -> None:
        self._sequence.new_publisher(seq)
        self._held.clear()
        self._ahead.clear()
        self._last_live = -1
        self._fruitless = 0
        self._end_replay()

    def _ask(self, first: int, now: float, *, opening: bool) -> None:
        assert self._socket is not None
        self._replay = _Replay(first, opening, now)
        self._socket.ask(first)

    def _end_replay(self) -> None:
        if self._replay is not None:
            self._replay = None
            assert self._socket is not None
            self._socket.drop()

    def _joined_now(self) -> None:
        if not self._joined and self._sequence.started:
            self._joined = True
            self._down.joined()

    def _settled(self) -> None:
        """After each input: tell the loop where the sequence is, and update the lag's inputs."""
        sequence = self._sequence
        self._down.position(sequence.last_seq)
        self.known = max(self._last_live, sequence.last_seq)
        self.oldest_held_at = next(iter(self._held.values())).received_at if self._held else None
