"""The file names and the checksum check an index directory and its shard directories share.

Both are checked the same way before anything in them is read (DESIGN.md, decision 15): every
file the manifest names is there and has the sha256 the manifest recorded.
"""

from __future__ import annotations

from pathlib import Path

from specrag.atomic import sha256_file
from specrag.errors import ArtifactError

__all__ = ["INDEX_FILE", "MANIFEST_FILE", "verify_files"]

MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.faiss"


def verify_files(directory: Path, checksums: dict[str, str]) -> None:
    """Raise ArtifactError naming the first file in ``checksums`` missing from ``directory`` or
    not matching its recorded sha256."""
    for name, expected in checksums.items():
        path = directory / name
        if not path.is_file():
            raise ArtifactError(f"index file missing: {path}")
        if sha256_file(path) != expected:
            raise ArtifactError(
                f"index file {path} does not match its manifest checksum (truncated or replaced)"
            )
