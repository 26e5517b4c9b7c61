"""A sharded index on disk: one checked directory per shard inside the index directory.

The index directory is written as any other (:func:`specrag.retrieval.index_store.save_index`:
embedder, passage ids, lexical channel, a manifest with a sha256 of every file), except that
the searcher is ``shard-000/``, ``shard-001/``, ...: each written atomically on its own, with a
manifest naming its number, the shard count, the quantizer's checksum and a sha256 of its files.
The index manifest records the shard count and the quantizer's checksum, and checksums each
shard's manifest, so a shard swapped in from another build, a missing one or a damaged file is
an :class:`ArtifactError` naming it. A search actor loads one shard by itself (:func:`load_shard`),
its lists memory-mapped where faiss allows; a controller whose shards are searched by actors
holds their manifests only (:func:`shard_manifests`), never their vectors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from specrag.atomic import atomic_directory, reading_directory, sha256_file
from specrag.errors import ArtifactError, InvalidInputError
from specrag.retrieval.arrays import load_array
from specrag.retrieval.backends.local.staged_ivf import StagedIVF
from specrag.retrieval.backends.shards.added import AddedRows
from specrag.retrieval.backends.shards.build import quantizer_digest
from specrag.retrieval.backends.shards.merge import Shard, ShardedSearcher
from specrag.retrieval.index_files import INDEX_FILE, MANIFEST_FILE, read_manifest, verify_files
from specrag.retrieval.live_index import Visibility
from specrag.retrieval.search.stages import StageCursor, StagedSearcher

__all__ = [
    "ROWS_FILE",
    "SHARD_FORMAT",
    "ShardManifest",
    "load_shard",
    "load_shards",
    "replayed_rows",
    "save_shards",
    "shard_directory",
    "shard_manifests",
    "sharded",
]

SHARD_FORMAT = "specrag-index-shard"
SHARD_VERSION = 1
# The rows an HNSW shard's graph positions stand for (an IVF shard's lists hold their rows).
ROWS_FILE = "rows.npy"


def shard_directory(index_directory: Path, number: int) -> Path:
    """Where shard ``number`` of the index in ``index_directory`` lives."""
    return index_directory / f"shard-{number:03d}"


def sharded(settings: Mapping[str, Any]) -> bool:
    """Whether a searcher's settings (as an index manifest records them) are a sharded index's:
    the one test of it, on what the index says of itself rather than on its searcher's class."""
    return "shards" in settings


def replayed_rows(searcher: StagedSearcher) -> list[AddedRows]:
    """The rows the live log replayed onto a sharded index's manifests, one a shard, for their
    actors to receive (none for shards loaded in this process); InvalidInputError for a searcher
    that is not this backend's."""
    if not isinstance(searcher, ShardedSearcher):
        raise InvalidInputError(f"a {searcher.kind} index is not sharded")
    return [shard.added for shard in searcher.shards if isinstance(shard, ShardManifest)]


def save_shards(searcher: ShardedSearcher, staging: Path) -> list[str]:
    """Write every shard of ``searcher`` into ``staging`` (the index's version being written);
    returns the shard manifests, for the index manifest to checksum."""
    count = len(searcher.shards)
    written = []
    for number, shard in enumerate(searcher.shards):
        directory = shard_directory(staging, number)
        with atomic_directory(directory) as part:
            faiss.write_index(shard.owner, str(part / INDEX_FILE))  # type: ignore[attr-defined]
            files = [INDEX_FILE]
            if shard.kind != StagedIVF.kind:  # a graph: its positions are not its rows
                np.save(part / ROWS_FILE, shard.rows, allow_pickle=False)  # type: ignore[attr-defined]
                files.append(ROWS_FILE)
            manifest = {
                "format": SHARD_FORMAT,
                "version": SHARD_VERSION,
                "shard": number,
                "shards": count,
                "quantizer_sha256": searcher.quantizer_sha256,
                "ntotal": shard.ntotal,
                "next_row": searcher.next_row,
                "searcher": shard.settings,
                "files": {name: sha256_file(part / name) for name in files},
            }
            (part / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        written.append(f"{directory.name}/{MANIFEST_FILE}")
    return written


def load_shards(directory: Path, settings: dict[str, Any]) -> ShardedSearcher:
    """The sharded searcher of the index version in ``directory``, whose manifest's searcher
    ``settings`` name the shard count and the quantizer; every shard is checked against them."""
    count = _shard_count(directory, settings)
    quantizer = settings.get("quantizer_sha256")
    shards = [
        load_shard(shard_directory(directory, number), number, count, quantizer) for number in range(count)
    ]
    next_rows = {shard.next_row for shard in shards}
    keep_max = bool(shards[0].index.metric_type == faiss.METRIC_INNER_PRODUCT)
    return ShardedSearcher(shards, quantizer, keep_max, next_row=max(next_rows))


def shard_manifests(directory: Path, settings: dict[str, Any], dim: int, keep_max: bool) -> ShardedSearcher:
    """The sharded index in ``directory`` as its shards' manifests only (:class:`ShardManifest`),
    checked as :func:`load_shards` checks them but without reading a vector: what a controller
    holds while actors elsewhere load and search the shards (``dim`` and ``keep_max`` are the
    index manifest's)."""
    count = _shard_count(directory, settings)
    quantizer = settings.get("quantizer_sha256")
    shards = []
    for number in range(count):
        with reading_directory(shard_directory(directory, number)) as version:
            manifest = _checked_manifest(version, number, count, quantizer)
        shards.append(ShardManifest(manifest, dim))
    next_row = max(shard.next_row for shard in shards)
    return ShardedSearcher(shards, quantizer, keep_max, next_row=next_row)


class ShardManifest:
    """A shard known by its manifest alone: its size and settings, not its vectors. It stands in
    for a shard that an actor elsewhere holds, so searching it here is a mistake; rows added to
    it (the live log replayed at start) are kept in :attr:`added`, for its actor to receive."""

    def __init__(self, manifest: dict[str, Any], dim: int) -> None:
        self._manifest = manifest
        self.kind: str = manifest["searcher"]["kind"]
        self.dim = dim
        self.settings: dict[str, Any] = manifest["searcher"]
        self.added = AddedRows(int(manifest["ntotal"]), int(manifest["next_row"]), dim)

    @property
    def ntotal(self) -> int:
        return self.added.ntotal

    @property
    def next_row(self) -> int:
        return self.added.next_row

    def _elsewhere(self) -> InvalidInputError:
        return InvalidInputError(
            f"shard {self._manifest['shard']} of this index is not loaded in this process "
            "(its actor searches it)"
        )

    @property
    def expected_units(self) -> int:
        raise self._elsewhere()

    def cursor(self, queries: np.ndarray, k: int, visibility: Visibility | None = None) -> StageCursor:
        raise self._elsewhere()

    def search(
        self, queries: np.ndarray, k: int, visibility: Visibility | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        raise self._elsewhere()

    def add_rows(self, vectors: np.ndarray, rows: np.ndarray, next_row: int) -> None:
        self.added.record(vectors, rows, next_row)

    def compacted(self, keep: np.ndarray) -> Any:
        raise self._elsewhere()

    def stored_vectors(self, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise self._elsewhere()


def _shard_count(directory: Path, settings: dict[str, Any]) -> int:
    """The shard count the manifest's ``settings`` name, once every shard directory is there."""
    count = settings.get("shards")
    if not isinstance(count, int) or count < 1:
        raise ArtifactError(f"{directory / MANIFEST_FILE}: bad shard count {count!r}")
    found = sorted(path.name for path in directory.glob("shard-*"))
    expected = [shard_directory(directory, number).name for number in range(count)]
    if found != expected:
        raise ArtifactError(
            f"{directory}: the manifest names {count} shards ({', '.join(expected)}), found {found}"
        )
    return count


def load_shard(
    directory: Path, number: int, count: int, quantizer_sha256: str | None, mmap: bool = False
) -> Any:
    """Shard ``number`` of ``count`` from its directory, checked: its manifest, its files'
    checksums, and (IVF) its quantizer against ``quantizer_sha256``. ``mmap`` maps an IVF
    shard's lists from the file instead of reading them (read-only: it takes no documents)."""
    with reading_directory(directory) as version:
        manifest = _checked_manifest(version, number, count, quantizer_sha256)
        verify_files(version, manifest["files"])
        path = version / INDEX_FILE
        try:
            raw = faiss.read_index(str(path), faiss.IO_FLAG_MMAP if mmap else 0)
        except RuntimeError as error:
            raise ArtifactError(f"cannot read faiss index {path}: {error}") from error
        settings = manifest["searcher"]
        shard = _shard_from(raw, settings, version, int(manifest["next_row"]))
    if shard.ntotal != manifest["ntotal"]:
        raise ArtifactError(f"{path}: {shard.ntotal} vectors, its manifest says {manifest['ntotal']}")
    if isinstance(shard, StagedIVF) and quantizer_digest(shard) != quantizer_sha256:
        raise ArtifactError(f"{path}: its centroids do not match the quantizer checksum")
    return shard


def _shard_from(raw: faiss.Index, settings: dict[str, Any], directory: Path, next_row: int) -> Shard:
    if settings.get("kind") == StagedIVF.kind and isinstance(raw, faiss.IndexIVF):
        return StagedIVF(raw, nprobe=int(settings["nprobe"]), next_row=next_row)
    if settings.get("kind") == "hnsw" and isinstance(raw, faiss.IndexHNSWFlat):
        from specrag.retrieval.backends.local.staged_hnsw import (
            StagedHNSW,
        )  # numba: see specrag.retrieval.index_store._staged_hnsw

        rows = load_array(directory / ROWS_FILE)
        if len(rows) != raw.ntotal:
            raise ArtifactError(f"{directory / ROWS_FILE}: {len(rows)} rows for {raw.ntotal} graph nodes")
        return StagedHNSW(raw, int(settings["ef_search"]), rows.astype(np.int64), next_row)
    raise ArtifactError(f"{directory}: a {type(raw).__name__} does not match the manifest's {settings}")


def _checked_manifest(version: Path, number: int, count: int, quantizer_sha256: str | None) -> dict[str, Any]:
    """The manifest of the shard in ``version``, once it says it is shard ``number`` of ``count``
    over the quantizer ``quantizer_sha256``."""
    manifest = _read_shard_manifest(version)
    if (manifest["shard"], manifest["shards"]) != (number, count):
        raise ArtifactError(
            f"{version}: shard {manifest['shard']} of {manifest['shards']}, "
            f"expected shard {number} of {count}"
        )
    if manifest["quantizer_sha256"] != quantizer_sha256:
        raise ArtifactError(f"{version}: its quantizer is not the index's (a shard of another build)")
    return manifest


def _read_shard_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST_FILE
    required = (
        "format",
        "version",
        "shard",
        "shards",
        "quantizer_sha256",
        "ntotal",
        "next_row",
        "searcher",
        "files",
    )
    manifest = read_manifest(path, "shard manifest", required)
    if (manifest["format"], manifest["version"]) != (SHARD_FORMAT, SHARD_VERSION):
        raise ArtifactError(f"{path}: unsupported shard format {manifest['format']} v{manifest['version']}")
    return manifest
