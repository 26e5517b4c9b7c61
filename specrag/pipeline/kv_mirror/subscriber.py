"""Subscriber to vLLM's KV-cache event stream, feeding the knowledge tree's exact residency.

vLLM publishes ``(topic, sequence number, msgpack KVEventBatch)`` on a ZMQ PUB socket and keeps
recent batches for a ROUTER "replay" socket (how they are followed in order:
:mod:`.sequence`; how holes are replayed while live batches keep coming: :mod:`.reassembly`).

The sockets are read on a thread of their own, never on the service's event loop: a loop busy
answering would otherwise leave batches in ZMQ's queues, which drop what comes past their
high-water mark (1,000 messages by default) without a word. Our SUB and DEALER sockets take
everything (receive high-water mark 0, unbounded); vLLM's PUB keeps its configured ``hwm``
(100,000) and its ROUTER ZMQ's default 1,000, which we cannot change from here: a replay answer
longer than that may lose frames, and the replay is then asked again from its first hole. The
thread decodes and orders the batches and hands them to the loop, which applies a bounded amount
per turn (:mod:`.handoff`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time

import zmq

from specrag.pipeline.kv_mirror.handoff import Handoff
from specrag.pipeline.kv_mirror.reassembly import Reassembly
from specrag.pipeline.kv_mirror.sequence import EventSequence
from specrag.pipeline.kv_mirror.target import MirrorLag, MirrorTarget

__all__ = ["BLOCKS_PER_TURN", "KVEventSubscriber"]

logger = logging.getLogger(__name__)

BLOCKS_PER_TURN = 512
"""Block events the loop applies per turn at most, before it lets other work run (docs/ordering.md)."""

_END_OF_REPLAY = -1
_READS_PER_TURN = 256  # messages read from one socket before the thread looks at the others
_STOP_WAIT_S = 5.0
_wake_names = itertools.count()


class KVEventSubscriber:
    """Receive vLLM KV-event batches in order and feed them to ``target``.

    ``replay_endpoint=None`` disables gap filling (gaps are then counted lost, and the first batch
    received opens the sequence). ``catch_up`` (default) replays every batch the engine published
    before the subscription joined: what a mirror of an engine that already served requests
    needs; a caller that has just emptied the engine's cache (and told its tree so) passes
    ``catch_up=False``. A replay ends after ``replay_idle_s`` without a frame; ``replay_attempts``
    replays in a row that bring nothing count a hole lost.

    ``joined`` is set once the sequence is open and its start-up replay applied. ``failure`` holds
    what stopped the receiving thread when it ended by itself (the target is told it is unsure):
    its owner subscribes again.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        target: MirrorTarget,
        *,
        replay_idle_s: float = 1.0,
        replay_attempts: int = 3,
        catch_up: bool = True,
        blocks_per_turn: int = BLOCKS_PER_TURN,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._handoff = Handoff(target, blocks_per_turn=blocks_per_turn)
        self.sequence = EventSequence(self._handoff.target, catch_up=catch_up)
        self.joined = self._handoff.joined_event
        self._replay_idle_s = replay_idle_s
        self._replay_attempts = replay_attempts
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._wake: zmq.Socket[bytes] | None = None
        self._receiver: _Receiver | None = None

    @property
    def failure(self) -> BaseException | None:
        return self._handoff.failure

    @property
    def applied_batches(self) -> int:
        return self._handoff.applied_batches

    @property
    def callback_errors(self) -> int:
        return self._handoff.callback_errors

    def lag(self) -> MirrorLag:
        """Batches received (or being replayed) and not yet applied, and for how long."""
        receiver = self._receiver
        if receiver is None:
            return MirrorLag()
        return self._handoff.lag(receiver.reassembly.known, receiver.reassembly.oldest_held_at)

    async def start(self) -> None:
        """Connect and start receiving on a thread of its own."""
        if self._receiver is not None:
            raise RuntimeError("the KV event subscriber is already running")
        self._handoff.bind(asyncio.get_running_loop())
        self._context = zmq.Context()
        wake_address = f"inproc://kv-event-subscriber-wake-{next(_wake_names)}"
        self._wake = self._context.socket(zmq.PAIR)
        self._wake.bind(wake_address)
        poller = zmq.Poller()  # the receiving thread's
        replay = (
            None
            if self.replay_endpoint is None
            else _ReplaySocket(self._context, poller, self.replay_endpoint)
        )
        reassembly = Reassembly(
            self.sequence, self._handoff, replay, idle_s=self._replay_idle_s, attempts=self._replay_attempts
        )
        self._receiver = _Receiver(
            self._context, poller, wake_address, self.endpoint, self.topic, reassembly, replay, self._handoff
        )
        self._receiver.start()

    async def stop(self) -> None:
        """Stop receiving and close the sockets; safe to call twice."""
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            assert self._wake is not None
            with contextlib.suppress(zmq.Again):  # a thread that ended by itself reads nothing
                self._wake.send(b"stop", zmq.NOBLOCK)
            await asyncio.to_thread(receiver.join, _STOP_WAIT_S)
            if receiver.is_alive():
                logger.error("the KV event subscriber's thread did not stop within %s s", _STOP_WAIT_S)
        self._handoff.close()  # what it still holds is not applied: the mirror stops or subscribes anew
        if self._wake is not None:
            self._wake.close(linger=0)
            self._wake = None
        if self._context is not None:
            if receiver is None or not receiver.is_alive():
                self._context.term()
            self._context = None


class _ReplaySocket:
    """The replay socket, driven from the receiving thread (a :class:`.reassembly.ReplaySocket`).

    A DEALER socket of its own per request, closed after it: the answer to a request dropped goes
    to a closed socket (ROUTER drops it) and can never be taken for another's.
    """

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], poller: zmq.Poller, endpoint: str) -> None:
        self._context = context
        self._poller = poller
        self._endpoint = endpoint
        self.dealer: zmq.Socket[bytes] | None = None

    def ask(self, first: int) -> None:
        self.drop()
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, 0)  # unbounded: see the module docstring
        dealer.connect(self._endpoint)
        dealer.send_multipart((b"", first.to_bytes(8, "big")))
        self._poller.register(dealer, zmq.POLLIN)
        self.dealer = dealer

    def drop(self) -> None:
        dealer, self.dealer = self.dealer, None
        if dealer is not None:
            self._poller.unregister(dealer)
            dealer.close(linger=0)


class _Receiver(threading.Thread):
    """The thread reading the SUB socket and the replay's DEALER into ``reassembly``."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        poller: zmq.Poller,
        wake_address: str,
        endpoint: str,
        topic: str,
        reassembly: Reassembly,
        replay: _ReplaySocket | None,
        handoff: Handoff,
    ) -> None:
        super().__init__(name=f"kv-events {endpoint}", daemon=True)
        self._context = context
        self._wake_address = wake_address
        self._endpoint = endpoint
        self._topic = topic
        self.reassembly = reassembly
        self._handoff = handoff
        self._replay = replay
        self._poller = poller

    def run(self) -> None:
        sockets: list[zmq.Socket[bytes]] = []
        try:
            self._receive(sockets)
        except Exception as error:
            if self._handoff.loop_closed:  # the service ended without stopping it: nobody to tell
                logger.debug("the KV event subscriber for %s stopped with its loop", self._endpoint)
                return
            logger.error("the KV event subscriber for %s stopped", self._endpoint, exc_info=error)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._handoff.failed(error)
        finally:
            if self._replay is not None:
                self._replay.drop()
            for socket in sockets:
                socket.close(linger=0)

    def _receive(self, sockets: list[zmq.Socket[bytes]]) -> None:
        sub = self._context.socket(zmq.SUB)
        sockets.append(sub)
        sub.setsockopt(zmq.RCVHWM, 0)  # unbounded: see the module docstring
        sub.setsockopt(zmq.SUBSCRIBE, self._topic.encode())
        # Watched before connecting, so that the handshake cannot be missed.
        monitor: zmq.Socket[bytes] | None = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        assert monitor is not None
        sockets.append(monitor)
        sub.connect(self._endpoint)
        wake = self._context.socket(zmq.PAIR)
        sockets.append(wake)
        wake.connect(self._wake_address)
        for socket in (sub, monitor, wake):
            self._poller.register(socket, zmq.POLLIN)
        reassembly = self.reassembly
        while True:
            deadline = reassembly.deadline()
            timeout_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
            ready = dict(self._poller.poll(timeout_ms))
            if wake in ready:
                return
            if monitor is not None and monitor in ready:
                monitor.recv_multipart()  # the SUB socket's handshake with the publisher
                self._poller.unregister(monitor)
                sub.disable_monitor()
                monitor.close(linger=0)
                monitor = None
                reassembly.handshake(time.monotonic())
            dealer = None if self._replay is None else self._replay.dealer
            if dealer is not None and dealer in ready:
                self._read_replay(dealer)
            if sub in ready:
                for _ in range(_READS_PER_TURN):
                    try:
                        _topic, seq_bytes, payload = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    reassembly.live(int.from_bytes(seq_bytes, "big", signed=True), payload, time.monotonic())
            reassembly.tick(time.monotonic())

    def _read_replay(self, dealer: zmq.Socket[bytes]) -> None:
        assert self._replay is not None
        reassembly = self.reassembly
        for _ in range(_READS_PER_TURN):
            if self._replay.dealer is not dealer:  # ended, or asked anew, by what was just read
                return
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == _END_OF_REPLAY:
                reassembly.replay_ended(time.monotonic())
            else:
                reassembly.replayed(seq, frames[-1], time.monotonic())
