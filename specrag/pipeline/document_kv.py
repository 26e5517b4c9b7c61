"""The document KV store: each prompt segment's per-layer keys and values, computed alone, on disk.

TurboRAG's offline half. A segment (a document as the prompt builder lays it out, or the system
prompt) is prefilled once with nothing before it, starting at position 0, and its KV kept here; at
query time :mod:`specrag.pipeline.turbo_connector` writes it into a request's KV blocks wherever the
segment sits in the prompt, rotating the keys to their new positions (:mod:`specrag.pipeline.rope`).

Entries are keyed by what makes KV reusable: the model (a fingerprint of its config and weights
file), the dtype the engine computes in, the KV block size (a namespace directory), and the
segment's token IDs (a hash; the file name). One file per segment, ``[layers, 2, kv_heads, tokens,
head_dim]`` in safetensors, written atomically, so a reader (the engine's scheduler and worker
processes read the same directory) sees a whole entry or none. The store is bounded in bytes: a
write that takes it over the bound evicts the least recently used entries (reads touch the file).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from specrag.atomic import atomic_write_bytes
from specrag.errors import ArtifactError, InvalidInputError

__all__ = [
    "LOADED_KEY",
    "PARAMS_KEY",
    "SUFFIX",
    "TURBO_CACHE_SALT",
    "DocumentKVStore",
    "model_fingerprint",
    "segment_key",
    "store_namespace",
]

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
# The key of our part of a request's ``kv_transfer_params`` (read by the connector).
PARAMS_KEY = "specrag_turbo"
# The key under which the connector reports a finished request's tokens loaded from the store.
LOADED_KEY = "specrag_document_kv_tokens"
# The prefix-cache salt of turbo requests: their approximate blocks never serve a full prefill.
TURBO_CACHE_SALT = "specrag-turbo"
# Bytes of a model's weights file read for its fingerprint (the end: weights, not only the header).
_FINGERPRINT_TAIL = 1 << 20


def segment_key(token_ids: Sequence[int], spans: Sequence[Sequence[int]] = ()) -> str:
    """The store key of a segment: SHA-256 of its token IDs (little-endian uint32).

    A whole prompt saved with document spans loaded (a turbo prompt, for inspection) also hashes
    the spans: its KV differs from the same prompt's full prefill.
    """
    digest = hashlib.sha256(np.asarray(token_ids, dtype="<u4").tobytes())
    if spans:
        digest.update(b"spans" + np.asarray(spans, dtype="<u4").tobytes())
    return digest.hexdigest()[:40]


def model_fingerprint(model_dir: Path) -> str:
    """Short hash over a model's config.json and its weights files (sizes, headers, last MiB).

    KV depends on every weight; hashing whole multi-GB files at each start is too slow, so the
    fingerprint reads each safetensors file's header (tensor names, shapes, offsets) and its last
    MiB. A model changed only in weights that sit elsewhere keeps its fingerprint: clear the store
    (``rm -r``) after editing weights in place.
    """
    config = model_dir / "config.json"
    if not config.is_file():
        raise ArtifactError(f"no config.json in model directory {model_dir}")
    digest = hashlib.sha256(config.read_bytes())
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise ArtifactError(f"no *.safetensors weights in model directory {model_dir}")
    for path in weights:
        size = path.stat().st_size
        with path.open("rb") as handle:
            header_length = int.from_bytes(handle.read(8), "little")
            digest.update(path.name.encode() + size.to_bytes(8, "little"))
            digest.update(handle.read(min(header_length, size)))
            handle.seek(max(0, size - _FINGERPRINT_TAIL))
            digest.update(handle.read())
    return digest.hexdigest()[:16]


def store_namespace(fingerprint: str, dtype: torch.dtype, block_size: int) -> str:
    """The directory name of one (model, compute dtype, block size) inside a store root."""
    return f"{fingerprint}-{str(dtype).removeprefix('torch.')}-bs{block_size}"


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
        """The stored ``[layers, 2, kv_heads, tokens, head_dim]`` KV, or None (missing or unreadable).

        An unreadable entry (a disk error, a file from another writer) is removed so that the
        next use recomputes it.
        """
        from safetensors.torch import load

        path = self.path(key)
        try:
            data = path.read_bytes()
            kv = load(data)["kv"]
        except FileNotFoundError:
            return None
        except Exception as error:  # safetensors raises its own error types for a bad file
            logger.warning("dropping unreadable document KV entry %s: %s", path, error)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # most recently used: the last to be evicted
        return kv

    def put(self, key: str, kv: torch.Tensor, keep: Iterable[str] = ()) -> bool:
        """Store ``kv`` under ``key`` atomically, then evict down to the bound (never ``keep``).

        Returns False (and stores nothing) for an entry larger than the whole bound.
        """
        from safetensors.torch import save

        if kv.dim() != 5 or kv.shape[1] != 2:
            raise InvalidInputError(
                f"document KV must be [layers, 2, heads, tokens, dim], got {list(kv.shape)}"
            )
        data = save({"kv": kv.contiguous()})
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
