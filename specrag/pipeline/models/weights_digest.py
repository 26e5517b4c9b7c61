"""The digest of a model's whole weights, computed once and recorded beside them.

Document KV (:mod:`specrag.pipeline.document_kv.store`) depends on every weight, so its key must change
when any weight does; hashing gigabytes at every start is too slow. The digest of each weights
file is therefore recorded in ``specrag-weights.json`` in the model directory: when specrag makes
a model (conversion, random model) at the time it writes it, otherwise at first use. A recorded
digest is used only while its file still has the recorded size, modification time and a quick
probe (its header and last MiB); any change and the file is hashed whole again. A directory
that cannot be written (a read-only mount) is hashed at each use, and that is said at DEBUG.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from specrag.atomic import atomic_write_text, sha256_file
from specrag.errors import ArtifactError

__all__ = ["RECORD_NAME", "record_weights", "weights_digests"]

logger = logging.getLogger(__name__)

RECORD_NAME = "specrag-weights.json"
# Bytes at the end of a weights file read by the quick probe.
_PROBE_TAIL = 1 << 20


def _weights_files(model_dir: Path) -> list[Path]:
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise ArtifactError(f"no *.safetensors weights in model directory {model_dir}")
    return weights


def _probe(path: Path) -> str:
    """A cheap check that a file is still the one recorded: its header and its last MiB."""
    size = path.stat().st_size
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    with path.open("rb") as handle:
        header_length = int.from_bytes(handle.read(8), "little")
        digest.update(handle.read(min(header_length, size)))
        handle.seek(max(0, size - _PROBE_TAIL))
        digest.update(handle.read())
    return digest.hexdigest()


def _entry(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "probe": _probe(path),
        "sha256": sha256_file(path),
    }


def _recorded(model_dir: Path) -> dict[str, Any]:
    try:
        record = json.loads((model_dir / RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _still_valid(path: Path, entry: object) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
        return False
    stat = path.stat()
    return (entry.get("size"), entry.get("mtime_ns")) == (stat.st_size, stat.st_mtime_ns) and entry.get(
        "probe"
    ) == _probe(path)


def record_weights(model_dir: Path) -> dict[str, str]:
    """Hash every weights file of ``model_dir`` whole and record the digests there; returns them."""
    record = {path.name: _entry(path) for path in _weights_files(model_dir)}
    atomic_write_text(model_dir / RECORD_NAME, json.dumps(record, indent=2) + "\n")
    return {name: entry["sha256"] for name, entry in record.items()}


def weights_digests(model_dir: Path) -> dict[str, str]:
    """SHA-256 of each whole weights file (by name), from the record when it is still valid."""
    weights = _weights_files(model_dir)
    record = _recorded(model_dir)
    if set(record) == {path.name for path in weights} and all(
        _still_valid(path, record[path.name]) for path in weights
    ):
        return {path.name: record[path.name]["sha256"] for path in weights}
    logger.info("hashing the weights of %s (once: the digests are recorded beside them)", model_dir)
    try:
        return record_weights(model_dir)
    except OSError as error:
        logger.debug("cannot record the weights digests in %s (%s): hashed at each use", model_dir, error)
        return {path.name: sha256_file(path) for path in weights}
