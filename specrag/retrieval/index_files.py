"""The file names and the checksum check an index directory and its shard directories share.

Both are checked the same way before anything in them is read (docs/reliability.md, "Artefacts
on disk"): the manifest is read whole, with the keys its reader needs, and every file it names is
there and has the sha256 it recorded.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from specrag.atomic import sha256_file
from specrag.errors import ArtifactError

__all__ = ["INDEX_FILE", "MANIFEST_FILE", "read_manifest", "verify_files"]

MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.faiss"


def read_manifest(path: Path, what: str, required: Collection[str]) -> dict[str, Any]:
    """The JSON object at ``path``; ArtifactError naming ``what`` (say, "index manifest") when it
    cannot be read or lacks one of the ``required`` keys."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ArtifactError(f"corrupt {what} {path}: {error}") from error
    if not isinstance(manifest, dict) or not set(required) <= manifest.keys():
        raise ArtifactError(f"corrupt {what} {path}: expected the keys {sorted(required)}")
    return manifest


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
