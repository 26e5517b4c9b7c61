"""One writer at a time per artefact: an advisory lock on a file beside it.

Two ``specrag prepare`` (or a ``prepare`` and a ``serve``) on one data directory would otherwise
both decide an artefact is stale, both build it and race to put it in place. A writer takes
:func:`writer_lock` around "check, build, put in place", so the second one waits, then finds the
artefact up to date. The lock is ``fcntl.flock`` on ``.NAME.lock`` beside the artefact: the kernel
drops it when its holder dies, so a crashed writer never leaves a stale lock behind (the empty lock
file stays; it is not an artefact). The lock is re-entrant within a process, since a builder that
holds it calls writers (:mod:`specrag.atomic`) that take it too.

Top-level leaf module: every package may use it, it uses nothing of ours but the errors.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from specrag.errors import ArtifactError, ConflictError

__all__ = ["hold_writer_lock", "lock_file_of", "writer_lock"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05


@dataclass
class _Held:
    """This process's hold on one artefact's lock: the threads queue on ``guard``."""

    guard: threading.RLock = field(default_factory=threading.RLock)
    depth: int = 0
    fd: int | None = None


_registry_guard = threading.Lock()
_registry: dict[Path, _Held] = {}


def lock_file_of(artefact: Path) -> Path:
    """The lock file of ``artefact``: a hidden sibling, so it survives the artefact's replacement."""
    return artefact.parent / f".{artefact.name}.lock"


def _held(lock_file: Path) -> _Held:
    """This process's hold on ``lock_file``, however the path is spelt (a second ``open`` of the
    same file by this process would wait for its own lock for ever)."""
    with _registry_guard:
        return _registry.setdefault(lock_file.parent.resolve() / lock_file.name, _Held())


def _acquire(lock_file: Path, artefact: Path, timeout_s: float | None) -> int | None:
    """The descriptor holding the lock, or None where no lock file can be made: a read-only data
    directory, where nothing can be written either, is only read (a serve of built artefacts)."""
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        if error.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        logger.debug("cannot lock %s (%s): a read-only data directory is only read", artefact, error)
        return None
    try:
        with contextlib.suppress(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        logger.warning("another process is writing %s: waiting for it to finish", artefact)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            if deadline is not None and time.monotonic() >= deadline:
                raise ArtifactError(
                    f"another process has been writing {artefact} for over {timeout_s:g} s "
                    f"(it holds {lock_file}); wait for it, or stop it, and try again"
                )
            time.sleep(_POLL_S)
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def writer_lock(artefact: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold ``artefact``'s writer lock for the block; wait for another holder (at most ``timeout_s``).

    Waiting is said at WARNING, so a ``prepare`` that seems to hang says why.
    """
    lock_file = lock_file_of(artefact)
    held = _held(lock_file)
    with held.guard:
        if held.depth == 0:
            held.fd = _acquire(lock_file, artefact, timeout_s)
        held.depth += 1
        try:
            yield
        finally:
            held.depth -= 1
            if held.depth == 0 and held.fd is not None:
                os.close(held.fd)  # closing the descriptor releases the flock
                held.fd = None


def hold_writer_lock(artefact: Path, refusal: Callable[[str], str]) -> Callable[[], None]:
    """Take ``artefact``'s writer lock until the returned function is called: for a writer that
    holds it for its whole life (a live document log), not around one step.

    Another process's hold is met at once, not waited for: a serving process holds it as long as it
    serves, so waiting would hang. ``refusal(holder's pid)`` is then raised as
    :class:`ConflictError`. Re-entrant within a process, like :func:`writer_lock`; the holder's pid
    is written into the lock file so that the refusal can name it.
    """
    lock_file = lock_file_of(artefact)
    held = _held(lock_file)
    with held.guard:
        if held.depth == 0:
            lock_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holder = lock_file.read_text(encoding="ascii", errors="replace").strip() or "unknown"
                raise ConflictError(refusal(holder)) from None
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode("ascii"))
            held.fd = fd
        held.depth += 1
    released = threading.Event()

    def release() -> None:
        with held.guard:
            if released.is_set():
                return
            released.set()
            held.depth -= 1
            if held.depth == 0 and held.fd is not None:
                os.close(held.fd)  # closing the descriptor releases the flock
                held.fd = None

    return release
