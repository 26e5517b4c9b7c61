"""Atomic file and directory writes.

A crash or Ctrl-C while writing an index, a store or a model must never leave a half-written file
under the final name, because the next start would load it. Every artefact is therefore written
to a temporary sibling, flushed to disk (fsync) and renamed into place; rename is atomic on POSIX
within one filesystem. Top-level leaf module: every package may use it, it uses nothing of ours.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_directory", "atomic_file", "atomic_write_bytes", "atomic_write_text", "sha256_file"]

# mkstemp/mkdtemp create private (0600/0700) entries; artefacts are meant to be shared like any file.
_FILE_MODE = 0o644
_DIR_MODE = 0o755


def _fsync_dir(path: Path) -> None:
    """Persist a rename: the directory entry itself must reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see either the old file or the complete new one."""
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

    For writers that insist on a file name (faiss, hnswlib, sqlite) rather than bytes.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
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


@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield a temporary directory to fill; on success it replaces ``path`` as a whole.

    A previous directory at ``path`` is moved aside first and deleted only after the new one is in
    place, so an interrupted rebuild leaves the old artefact usable.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(staging, _DIR_MODE)
    try:
        yield staging
        for child in staging.rglob("*"):
            if child.is_file():
                with open(child, "rb+") as handle:
                    os.fsync(handle.fileno())
        retired: Path | None = None
        if path.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            retired.rmdir()
            os.replace(path, retired)
        os.replace(staging, path)
        _fsync_dir(path.parent)
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def sha256_file(path: Path, chunk_size: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, streamed, for manifests that detect truncated or swapped files."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()
