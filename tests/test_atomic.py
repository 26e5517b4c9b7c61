"""Atomic, locked writes: readers see the old artefact or the complete new one, never a partial one;
writers queue; a crash at any step leaves a whole artefact and no litter after the next write."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from specrag.atomic import (
    atomic_directory,
    atomic_file,
    atomic_write_text,
    reading_directory,
    sha256_file,
    versions_of,
)
from specrag.locking import lock_file_of

REPOSITORY = Path(__file__).resolve().parent.parent


def visible(directory: Path) -> list[str]:
    """What a directory holds besides the artefacts' lock files (which stay, empty, by design)."""
    locks = {lock_file_of(p).name for p in directory.iterdir()}
    return sorted(p.name for p in directory.iterdir() if p.name not in locks)


def test_write_replaces_and_leaves_no_temporaries(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "f.txt"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert [p.name for p in target.parent.iterdir()] == ["f.txt"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


def test_failed_file_write_keeps_the_old_content(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError), atomic_file(target) as staging:
        staging.write_text("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".f.bin.lock", "f.bin"]


def test_directory_swap_is_whole_or_nothing(tmp_path: Path) -> None:
    target = tmp_path / "index"
    with atomic_directory(target) as staging:
        (staging / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic_directory(target) as staging:
        (staging / "a").write_text("2")
        raise RuntimeError("crash")
    assert (target / "a").read_text() == "1"
    with atomic_directory(target) as staging:
        (staging / "b").write_text("3")
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    # The name, its one current version and the lock file: no temporaries, no ".old" directories.
    assert len(versions_of(target)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".index.lock", "index", versions_of(target)[0].name]
    )
    assert stat.S_IMODE(target.resolve().stat().st_mode) == 0o755


def test_a_plain_directory_from_before_is_adopted_and_replaced(tmp_path: Path) -> None:
    target = tmp_path / "index"
    target.mkdir()
    (target / "a").write_text("old")
    (tmp_path / ".index.abcd1234.old").mkdir()  # the previous scheme's litter
    with atomic_directory(target) as staging:
        (staging / "a").write_text("new")
    assert target.is_symlink() and (target / "a").read_text() == "new"
    assert len(versions_of(target)) == 1
    assert not (tmp_path / ".index.abcd1234.old").exists()


def test_a_version_being_read_is_kept_and_collected_by_the_next_write(tmp_path: Path) -> None:
    target = tmp_path / "index"
    with atomic_directory(target) as staging:
        (staging / "a").write_text("1")
    with reading_directory(target) as version:
        with atomic_directory(target) as staging:
            (staging / "a").write_text("2")
        assert (version / "a").read_text() == "1"  # still whole under its reader
        assert (target / "a").read_text() == "2"
    with atomic_directory(target) as staging:
        (staging / "a").write_text("3")
    assert len(versions_of(target)) == 1


def test_a_writer_killed_while_adopting_a_plain_directory_is_repaired_by_the_next(tmp_path: Path) -> None:
    target = tmp_path / "index"
    target.mkdir()
    (target / "a").write_text("old")
    for kill_at in range(1, 20):  # up to the first step after the plain directory was renamed aside
        run = subprocess.run(
            [sys.executable, "-c", _KILLED_WRITER, str(target), str(kill_at)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
            timeout=60,
        )
        assert run.returncode == -9, run.stderr
        if not target.exists():
            break
    assert not target.exists()
    with pytest.raises(RuntimeError), atomic_directory(target):
        raise RuntimeError("a writer that fails after the repair")
    assert (target / "a").read_text() == "old"


_WRITER = textwrap.dedent(
    """
    import hashlib, json, os, sys
    from pathlib import Path
    from specrag.atomic import atomic_directory

    target, writes, tag = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    failed = 0
    for i in range(writes):
        try:
            with atomic_directory(target) as staging:
                files = {}
                for name in ("a.bin", "b.bin"):
                    data = os.urandom(2048) + f"{tag}{i}".encode()
                    (staging / name).write_bytes(data)
                    files[name] = hashlib.sha256(data).hexdigest()
                (staging / "manifest.json").write_text(json.dumps(files))
        except Exception as error:
            failed += 1
            print("write failed:", repr(error), file=sys.stderr)
    print(json.dumps({"failed": failed}))
    """
)


def _read_whole(target: Path) -> bool:
    """Whether the artefact read whole: its manifest and every file it lists, matching."""
    import hashlib

    try:
        with reading_directory(target) as version:
            files = json.loads((version / "manifest.json").read_text())
            return all(hashlib.sha256((version / n).read_bytes()).hexdigest() == d for n, d in files.items())
    except (OSError, ValueError):
        return False


def test_two_writers_and_a_reader_never_fail_nor_see_an_incomplete_artefact(tmp_path: Path) -> None:
    """2 writers and a reader over 600 writes, 0 failed writes, 0 incomplete reads."""
    target = tmp_path / "artefact"
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(target), "300", tag],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for tag in "xy"
    ]
    reads = incomplete = 0
    deadline = time.monotonic() + 55
    while any(writer.poll() is None for writer in writers) and time.monotonic() < deadline:
        if target.exists() or target.is_symlink():
            reads += 1
            incomplete += not _read_whole(target)
    outputs = [writer.communicate(timeout=max(1.0, deadline - time.monotonic())) for writer in writers]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert [result["failed"] for result in results] == [0, 0], [err[-2000:] for _, err in outputs]
    assert reads > 100
    assert incomplete == 0
    assert _read_whole(target)
    assert visible(tmp_path) == sorted(["artefact", versions_of(target)[0].name])


_KILLED_WRITER = textwrap.dedent(
    """
    import os, shutil, signal, sys
    from pathlib import Path
    import specrag.atomic as atomic

    target, kill_at = Path(sys.argv[1]), int(sys.argv[2])
    steps = 0

    def step(function):
        def at_step(*args, **kwargs):
            global steps
            steps += 1
            if steps == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return function(*args, **kwargs)
        return at_step

    for name in ("replace", "symlink", "fsync", "mkdir", "unlink"):
        setattr(os, name, step(getattr(os, name)))
    shutil.rmtree = step(shutil.rmtree)
    if target.suffix == ".sqlite":
        with atomic.atomic_file(target) as staging:
            staging.write_text("new, complete")
    else:
        with atomic.atomic_directory(target) as staging:
            (staging / "content").write_text("new")
            (staging / "complete").write_text("yes")
    print("steps", steps)
    """
)


def test_a_file_writer_killed_at_any_step_leaves_the_old_or_the_new_file(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    for kill_at in range(1, 50):
        target = tmp_path / f"run{kill_at}" / "store.sqlite"
        with atomic_file(target) as staging:
            staging.write_text("old, complete")
        run = subprocess.run(
            [sys.executable, "-c", _KILLED_WRITER, str(target), str(kill_at)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert target.read_text() in {"old, complete", "new, complete"}
        if run.returncode == 0:
            break
        assert run.returncode == -9, run.stderr
        with atomic_file(target) as staging:  # the next write removes the killed one's temporary
            staging.write_text("after")
        assert visible(target.parent) == ["store.sqlite"]
    assert kill_at > 3


def test_a_writer_killed_at_any_step_leaves_a_servable_artefact(tmp_path: Path) -> None:
    """Kill -9 before each system call of a directory write: the old or the new version is whole,
    and the next write leaves no litter."""
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    killed_at = []
    for kill_at in range(1, 200):
        target = tmp_path / f"run{kill_at}" / "index"
        with atomic_directory(target) as staging:
            (staging / "content").write_text("old")
            (staging / "complete").write_text("yes")
        with atomic_directory(target) as staging:  # a second write: a superseded version to collect
            (staging / "content").write_text("old")
            (staging / "complete").write_text("yes")
        run = subprocess.run(
            [sys.executable, "-c", _KILLED_WRITER, str(target), str(kill_at)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        with reading_directory(target) as version:
            assert (version / "complete").read_text() == "yes"
            assert (version / "content").read_text() in {"old", "new"}
        if run.returncode == 0:
            break
        assert run.returncode == -9, run.stderr
        killed_at.append(kill_at)
        with atomic_directory(target) as staging:
            (staging / "content").write_text("after")
        assert (target / "content").read_text() == "after"
        assert visible(target.parent) == sorted(["index", versions_of(target)[0].name])
    assert len(killed_at) >= 8  # every step of a write was interrupted once


def test_sha256_file_detects_a_changed_byte(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    before = sha256_file(path)
    path.write_bytes(b"abd")
    assert sha256_file(path) != before
    assert before == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
