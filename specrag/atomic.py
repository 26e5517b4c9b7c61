"""Atomic, locked file and directory writes, and reads that see one whole version.

A crash or Ctrl-C while writing an index, a store or a model must never leave a half-written
artefact under the final name, because the next start would load it; and a reader must never
see a directory that is half replaced. So:

- a **file** is written to a temporary sibling, flushed to disk (fsync) and renamed over the old
  one (rename is atomic on POSIX within one filesystem);
- a **directory** is a *pointer*: the name is a symbolic link to a hidden, versioned sibling
  (``.NAME.v-<id>``) that is filled, fsynced and only then pointed at, by replacing the link with
  ``os.replace``. A reader that resolves the link gets a complete version; a crash at any step
  leaves the link on the old or on the new version, both whole. Superseded versions are removed
  after the swap unless a reader still holds them (:func:`reading_directory`); the next write
  removes what is left, together with anything a crashed writer left behind;
- writers of one artefact take its lock (:func:`specrag.locking.writer_lock`), so two writers
  queue instead of racing.

Top-level leaf module: every package may use it; it uses only the other leaf modules.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from specrag.errors import ArtifactError
from specrag.locking import writer_lock

__all__ = [
    "atomic_directory",
    "atomic_file",
    "atomic_write_bytes",
    "atomic_write_text",
    "reading_directory",
    "sha256_file",
    "versions_of",
]

logger = logging.getLogger(__name__)

# mkstemp/mkdtemp create private (0600/0700) entries; artefacts are meant to be shared like any file.
_FILE_MODE = 0o644
_DIR_MODE = 0o755
_VERSION_MARK = ".v-"
# The suffix of a version that was a plain directory before pointers: known to be whole.
_ADOPTED = "-adopted"
# How often a reader re-resolves a pointer whose version was collected under it (each retry
# follows a completed write, so more than a handful means a writer loop, not bad luck).
_READ_ATTEMPTS = 100
# How long a writer waits for the readers of a superseded version before leaving it to the next
# write, and how often it looks.
_COLLECT_WAIT_S = 2.0
_COLLECT_POLL_S = 0.01


def _fsync_dir(path: Path) -> None:
    """Persist a rename: the directory entry itself must reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _leftovers(path: Path) -> re.Pattern[str]:
    """Names a finished or crashed write of ``path`` may leave beside it: versions, temporaries,
    half-made links, retired directories (the previous scheme's ``.old``), half-deleted versions."""
    name = re.escape(path.name)
    return re.compile(
        rf"^\.{name}\.(v-[0-9a-f]{{24}}({_ADOPTED})?|[0-9a-f]{{24}}\.(link|dead)|[a-z0-9_]{{8}}\.(tmp|old))$"
    )


def versions_of(path: Path) -> list[Path]:
    """Every version directory of the pointer ``path`` on disk, the current one included."""
    pattern = _leftovers(path)
    if not path.parent.is_dir():
        return []
    return sorted(
        child
        for child in path.parent.iterdir()
        if pattern.match(child.name) and child.name.startswith(f".{path.name}{_VERSION_MARK}")
    )


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see either the old file or the complete new one.

    Takes no lock: for small files written whole, where the last of two writers wins and both
    versions are complete (document KV entries: one per segment, thousands of them).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """UTF-8 text variant of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path to write (by any library); on success it replaces ``path``.

    For writers that insist on a file name (faiss, hnswlib, sqlite) rather than bytes. Holds the
    file's writer lock, and removes what an earlier, crashed writer left.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with writer_lock(path):
        _collect(path, keep=None)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, _FILE_MODE)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            yield tmp
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)


def _fsync_tree(directory: Path) -> None:
    for child in directory.rglob("*"):
        if child.is_file() and not child.is_symlink():
            with open(child, "rb+") as handle:
                os.fsync(handle.fileno())
    for child in [*directory.rglob("*"), directory]:
        if child.is_dir() and not child.is_symlink():
            _fsync_dir(child)


def _current_version(path: Path) -> Path | None:
    """The version directory ``path`` points at, or None (no pointer yet, or a plain directory)."""
    if not path.is_symlink():
        return None
    return path.parent / os.readlink(path)


def _point(path: Path, version: Path) -> None:
    """Make ``path`` a link to ``version`` in one atomic step."""
    link = path.parent / f".{path.name}.{secrets.token_hex(12)}.link"
    os.symlink(version.name, link)
    try:
        os.replace(link, path)
    except BaseException:
        link.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _adopt_plain_directory(path: Path) -> None:
    """Turn a plain directory at ``path`` (written before pointers existed) into a version.

    A directory cannot be replaced by a link in one step, so this is the one moment a lock-free
    reader can find ``path`` missing: between the rename and the link, once per artefact, on its
    first rewrite. The adopted version is marked as whole, so a writer that dies in between is
    repaired by the next one (:func:`_repoint_adopted`).
    """
    if path.is_dir() and not path.is_symlink():
        adopted = path.parent / f".{path.name}{_VERSION_MARK}{secrets.token_hex(12)}{_ADOPTED}"
        os.replace(path, adopted)
        _point(path, adopted)


def _repoint_adopted(path: Path) -> None:
    """Point a missing ``path`` back at the directory an interrupted adoption renamed aside."""
    if path.exists() or path.is_symlink():
        return
    adopted = [version for version in versions_of(path) if version.name.endswith(_ADOPTED)]
    if adopted:
        _point(path, max(adopted, key=lambda version: version.stat().st_mtime_ns))


def _remove_version(path: Path, version: Path) -> bool:
    """Remove ``version`` once its readers are done (they load in seconds at most); True when it
    is gone, False when a reader still holds it after :data:`_COLLECT_WAIT_S`."""
    try:
        fd = os.open(version, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return True
    try:
        deadline = time.monotonic() + _COLLECT_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(_COLLECT_POLL_S)
        # Renamed first: a reader that resolved the old pointer sees it gone, never half deleted.
        dead = path.parent / f".{path.name}.{secrets.token_hex(12)}.dead"
        os.replace(version, dead)
        shutil.rmtree(dead, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def _collect(path: Path, keep: Path | None) -> None:
    """Remove every leftover of ``path``'s writes but ``keep`` (the caller holds the writer lock,
    so none of them is another writer's work in progress)."""
    pattern = _leftovers(path)
    for child in sorted(path.parent.iterdir()):
        if not pattern.match(child.name) or child == keep:
            continue
        if child.name.startswith(f".{path.name}{_VERSION_MARK}"):
            if not _remove_version(path, child):
                logger.debug("version %s is being read: removed by the next write", child)
        elif child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield a new, empty version directory to fill; on success ``path`` points at it.

    Holds the writer lock of ``path`` throughout. An exception (or a crash) before the swap
    leaves ``path`` on the previous version; after it, on the new one. Superseded versions, and
    what crashed writers left, are removed afterwards.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with writer_lock(path):
        _repoint_adopted(path)
        _adopt_plain_directory(path)
        _collect(path, keep=_current_version(path))
        version = path.parent / f".{path.name}{_VERSION_MARK}{secrets.token_hex(12)}"
        version.mkdir(mode=_DIR_MODE)
        os.chmod(version, _DIR_MODE)  # mkdir's mode is filtered by the umask
        try:
            yield version
            _fsync_tree(version)
            _fsync_dir(path.parent)
            _point(path, version)
        except BaseException:
            shutil.rmtree(version, ignore_errors=True)
            raise
        _collect(path, keep=version)


@contextlib.contextmanager
def reading_directory(path: Path) -> Iterator[Path]:
    """Yield the directory to read ``path`` from, held whole for the block.

    For a pointer that is the version it points at, locked (shared) so that no writer removes it
    while it is read: load what you need inside the block. A plain directory (a user's, or one
    written before pointers) is yielded as it is.
    """
    for _ in range(_READ_ATTEMPTS):
        version = _current_version(path)
        if version is None:
            yield path
            return
        try:
            fd = os.open(version, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            if _current_version(path) == version:  # a dangling link: the caller says what is missing
                yield version
                return
            continue  # replaced and collected since the link was read: read the new pointer
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                whole = os.path.samestat(os.stat(version), os.fstat(fd))
            except FileNotFoundError:
                whole = False  # collected between the open and the lock
            if whole:
                yield version
                return
        finally:
            os.close(fd)
    raise ArtifactError(f"{path} was replaced {_READ_ATTEMPTS} times while being read: a writer is looping")


def sha256_file(path: Path, chunk_size: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, streamed, for manifests that detect truncated or swapped files."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()
