"""Writers of one artefact queue on its lock; a holder that dies releases it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from specrag.errors import ArtifactError
from specrag.locking import lock_file_of, writer_lock

REPOSITORY = Path(__file__).resolve().parent.parent

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from specrag.locking import writer_lock

    with writer_lock(Path(sys.argv[1])):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
    """
)


def hold(target: Path, seconds: float) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(target), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_writer_waits_for_the_first(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = tmp_path / "index"
    holder = hold(target, 1.0)
    start = time.monotonic()
    with writer_lock(target):
        waited = time.monotonic() - start
    assert waited > 0.7  # the holder kept it for 1 s after saying so
    assert "another process is writing" in caplog.text and str(target) in caplog.text
    holder.wait()


def test_a_writer_that_cannot_wait_leaves_with_a_clear_message(tmp_path: Path) -> None:
    target = tmp_path / "store.sqlite"
    holder = hold(target, 5.0)
    try:
        with (
            pytest.raises(ArtifactError, match=rf"another process has been writing {target}.*try again"),
            writer_lock(target, timeout_s=0.2),
        ):
            pass
    finally:
        holder.kill()
        holder.wait()
    with writer_lock(target, timeout_s=2):  # the kernel released the dead holder's lock
        pass
    assert lock_file_of(target).is_file()


def test_the_lock_is_reentrant_within_a_process(tmp_path: Path) -> None:
    target = tmp_path / "model"
    with writer_lock(target), writer_lock(target, timeout_s=0.1):
        pass


def test_the_same_lock_under_another_spelling_is_the_same_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "data")
    with writer_lock(tmp_path / "data" / "index"), writer_lock(Path("link/index"), timeout_s=0.1):
        pass
