"""Client-side bounds on database calls: a deadline per call, kept by a watchdog thread that cuts
the connection of a call still running past it.

The server enforces ``statement_timeout`` only while the client hears it: a peer gone silent (a
proxy that stopped forwarding, a partitioned network, a frozen server) answers nothing at all, and
libpq then waits for ever. TCP keepalives and ``tcp_user_timeout`` end such a connection on TCP,
after their own delays, and never on a Unix socket. So every call runs under a :class:`Deadline`;
when it passes with the call unfinished, the :class:`Watchdog` sends the server a cancel request
for the statement (from a thread of its own, given :data:`CANCEL_TIMEOUT_S`: on a silent peer it
is not answered either) and shuts the connection's socket down, which wakes the caller's libpq at
once ("server closed the connection"): the call raises, and the pool discards the connection
instead of lending it again.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
from psycopg import pq

__all__ = ["CANCEL_TIMEOUT_S", "Deadline", "Watchdog"]

logger = logging.getLogger(__name__)

# How long a cancel request sent for a call past its deadline may take (a thread of its own).
CANCEL_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Deadline:
    """A moment on the monotonic clock by which a call (or a whole search) must be done."""

    at: float
    #: The bound it was made with, for messages.
    seconds: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds, seconds)

    def left(self) -> float:
        """Seconds left, 0 once passed."""
        return max(0.0, self.at - time.monotonic())

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.at


class _Watch:
    """One call on one connection: finished by its caller, or expired by the watchdog, never both."""

    def __init__(self, connection: psycopg.Connection) -> None:
        self._connection = connection
        self._lock = threading.Lock()
        self._finished = False
        #: Whether the watchdog cut the call (its error is then the deadline's, not the driver's).
        self.expired = False

    @property
    def finished(self) -> bool:
        return self._finished

    def finish(self) -> None:
        # Taken under the lock: a cut in progress ends before the caller may hand the connection
        # back (the pool may close it, and the cut reads it).
        with self._lock:
            self._finished = True

    def expire(self) -> None:
        with self._lock:
            if self._finished:
                return
            self.expired = True
            pgconn = self._connection.pgconn
            cancel = None
            with contextlib.suppress(psycopg.Error, AttributeError):  # no libpq 17: no cancel, only the cut
                cancel = pgconn.cancel_conn()
            with contextlib.suppress(psycopg.Error, OSError):
                _shut_down(pgconn.socket)
        if cancel is not None:
            threading.Thread(target=_send_cancel, args=(cancel,), name="pg-cancel", daemon=True).start()


def _shut_down(fd: int) -> None:
    """Shut down the socket behind ``fd`` without closing ``fd`` (libpq owns it): every read on it
    ends at once, in whichever thread waits."""
    duplicate = socket.socket(fileno=os.dup(fd))
    try:
        duplicate.shutdown(socket.SHUT_RDWR)
    finally:
        duplicate.close()


def _send_cancel(cancel: pq.abc.PGcancelConn) -> None:
    """Ask the server to cancel the statement, within :data:`CANCEL_TIMEOUT_S`; silence is logged."""
    deadline = time.monotonic() + CANCEL_TIMEOUT_S
    try:
        cancel.start()
        while (status := cancel.poll()) not in (pq.PollingStatus.OK, pq.PollingStatus.FAILED):
            left = deadline - time.monotonic()
            if left <= 0:
                logger.info("the cancel request for a call past its deadline was not answered")
                return
            reading = status == pq.PollingStatus.READING
            select.select([cancel.socket] if reading else [], [] if reading else [cancel.socket], [], left)
    except (psycopg.Error, OSError, ValueError) as error:
        logger.info("the cancel request for a call past its deadline failed: %s", error)
    finally:
        cancel.finish()


class Watchdog:
    """One thread that expires the calls past their deadline (started with the first call)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._due: list[tuple[float, int, _Watch]] = []
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, connection: psycopg.Connection, deadline: Deadline) -> Iterator[_Watch]:
        """Run the body's calls on ``connection`` until ``deadline`` at most: past it, the watchdog
        cuts the connection (the body then raises the driver's error; the watch says ``expired``)."""
        watch = _Watch(connection)
        with self._changed:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            heapq.heappush(self._due, (deadline.at, next(self._order), watch))
            if self._due[0][2] is watch:  # due first: the thread waits for a later one
                self._changed.notify()
        try:
            yield watch
        finally:
            watch.finish()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        if self._thread is not None:
            self._thread.join(5.0)

    def _run(self) -> None:
        with self._changed:
            while not self._closed:
                while self._due and self._due[0][2].finished:
                    heapq.heappop(self._due)
                if not self._due:
                    self._changed.wait()
                    continue
                wait = self._due[0][0] - time.monotonic()
                if wait > 0:
                    self._changed.wait(wait)
                    continue
                heapq.heappop(self._due)[2].expire()
