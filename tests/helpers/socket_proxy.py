"""A Unix-socket proxy in front of a local PostgreSQL that can go silent: the stalled-database
fault (a peer that stops answering without closing anything), on loopback only and bounded."""

from __future__ import annotations

import contextlib
import selectors
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from types import TracebackType

__all__ = ["StallingProxy"]

_SOCKET = ".s.PGSQL.5432"  # libpq's socket name for the default port
_POLL_S = 0.05


class StallingProxy:
    """Forwards connections on a socket of its own to the server's socket in ``target_dir``.

    :meth:`stall` stops forwarding: nothing is read, accepted or closed, so every connection and
    every new one waits as on a silent peer; :meth:`resume` forwards again (what was sent meanwhile
    is still in the kernel's buffers and goes through). :meth:`close` (or ``with``) ends it all.
    """

    def __init__(self, target_dir: Path) -> None:
        self.target = str(Path(target_dir) / _SOCKET)
        self.root = Path(tempfile.mkdtemp(prefix="specrag-px-"))  # short: a socket path is < 108 bytes
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.root / _SOCKET))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._stop = threading.Event()
        self._peers: dict[socket.socket, socket.socket] = {}
        self._thread = threading.Thread(target=self._run, name="stalling-proxy", daemon=True)
        self._thread.start()

    @property
    def dsn(self) -> str:
        """A DSN that reaches the server through the proxy."""
        return f"host={self.root} user=postgres dbname=postgres"

    def stall(self) -> None:
        self._forwarding.clear()

    def resume(self) -> None:
        self._forwarding.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in [self._listener, *self._peers]:
            with contextlib.suppress(OSError):
                sock.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> StallingProxy:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _run(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            while not self._stop.is_set():
                if not self._forwarding.is_set():
                    self._stop.wait(_POLL_S)
                    continue
                for key, _ in selector.select(_POLL_S):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self._listener:
                        self._accept(selector)
                    elif self._forwarding.is_set():
                        self._pump(selector, sock)

    def _accept(self, selector: selectors.BaseSelector) -> None:
        with contextlib.suppress(BlockingIOError):
            client, _ = self._listener.accept()
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(self.target)
            self._peers[client], self._peers[upstream] = upstream, client
            for sock in (client, upstream):
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ)

    def _pump(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        other = self._peers.get(sock)
        if other is None:
            return
        try:
            data = sock.recv(65536)
            if data:
                other.setblocking(True)
                other.sendall(data)
                other.setblocking(False)
                return
        except OSError:
            pass
        for end in (sock, other):  # one side closed: close the pair
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(end)
            self._peers.pop(end, None)
            with contextlib.suppress(OSError):
                end.close()
