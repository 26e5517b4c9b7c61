"""A service whose sharded index is searched by Ray actors (``serve --ray --search-shards N``).

The index is loaded without its shards' vectors (:mod:`specrag.service.run.assets`, ``shard_vectors``:
their checksummed manifests only) and checked against the corpus by its passage ids; before any
engine starts, its shard count is checked against ``--search-shards`` (a mismatch is an
:class:`InvalidInputError`: exit 2 with the reason), one actor per shard loads its shard from the
index directory (:mod:`specrag.service.run.search_actors`), and the index searches through them from
then on. The controller keeps the embedder, the passage ids, the hidden rows, the BM25 channel and
the merge: never a shard's vectors, so the index may be larger than its machine. Documents
replayed from the live log at start were kept by the shards' manifests; each actor receives its
own before the service answers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specrag.errors import InvalidInputError
from specrag.retrieval.shards.merge import ShardedSearcher
from specrag.retrieval.shards.store import ShardManifest
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.options import ServiceOptions

__all__ = ["check_search_shards", "searching_on_shards"]


def check_search_shards(index: VectorIndex, count: int, directory: str) -> dict[str, Any]:
    """The searcher settings of ``index`` when it has ``count`` shards, else InvalidInputError
    saying what it has and how to build what was asked."""
    settings = index.searcher.settings
    if not isinstance(index.searcher, ShardedSearcher):
        raise InvalidInputError(
            f"--search-shards {count}: the index in {directory} is not sharded "
            f"(build it with `specrag index build --shards {count}`)"
        )
    if settings["shards"] != count:
        raise InvalidInputError(
            f"--search-shards {count}: the index in {directory} has {settings['shards']} shards "
            f"(give --search-shards {settings['shards']}, or rebuild it with --shards {count})"
        )
    return settings


@contextlib.contextmanager
def searching_on_shards(index: VectorIndex, options: ServiceOptions) -> Iterator[None]:
    """Within the block, ``index`` searches through one Ray actor per shard (nothing changes
    without ``options.search_shards``); Ray is started here unless it runs already, and then
    also serves the engine replicas."""
    if options.search_shards is None:
        yield
        return
    assert options.index_dir is not None, "the service options name the index directory with the shard count"
    settings = check_search_shards(index, options.search_shards, options.index_dir)
    import ray

    from specrag.service.run.search_actors import search_shards

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=options.ray_address or None, include_dashboard=False, log_to_driver=False)
    previous = index.searcher
    assert isinstance(previous, ShardedSearcher), "check_search_shards admits sharded indexes only"
    # The rows the live log replayed onto the manifests, for the actors to receive.
    added = [shard.added for shard in previous.shards if isinstance(shard, ShardManifest)]
    try:
        with search_shards(Path(options.index_dir), settings, added=added or None) as remote:
            if remote.ntotal != previous.ntotal:
                raise InvalidInputError(
                    f"the index holds {previous.ntotal} rows, its shard files {remote.ntotal}: documents "
                    "were added to shards loaded in this process; rebuild it (`specrag index build`)"
                )
            index.searcher = remote
            try:
                yield
            finally:
                index.searcher = previous
    finally:
        if started_ray:
            ray.shutdown()
