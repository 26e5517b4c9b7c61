"""Atomic writes: readers see the old artefact or the complete new one, never a partial one."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from specrag.atomic import atomic_directory, atomic_file, atomic_write_text, sha256_file


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
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]


def test_sha256_file_detects_a_changed_byte(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    before = sha256_file(path)
    path.write_bytes(b"abd")
    assert sha256_file(path) != before
    assert before == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
