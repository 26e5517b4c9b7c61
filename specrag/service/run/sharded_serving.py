"""A service whose sharded index is searched by Ray actors (``serve --ray --search-shards N``).

The index is loaded without its shards' vectors (:mod:`specrag.service.run.assets`, ``shard_vectors``:
their checksummed manifests only) and checked against the corpus by its passage ids; before any
engine starts, its shard count is checked against ``--search-shards`` (a mismatch is an
:class:`InvalidInputError`: exit 2 with the reason), one actor per shard loads its shard from the
index directory (:mod:`specrag.retrieval.backends.shards.search_actors`), and the index searches
through them from then on. The controller keeps the embedder, the passage ids, the hidden rows, the
BM25 channel and the merge: never a shard's vectors, so the index may be larger than its machine. Documents
replayed from the live log at start were kept by the shards' manifests; each actor receives its
own before the service answers.

Placement: each shard actor asks Ray for a share of a CPU (:func:`shard_cpus`), so that the
shards and the engine replicas fit the cluster together (on one 2-core machine: one core for the
engine, half a core for each of two shards); a request the cluster can never satisfy is refused
before any actor starts, naming what is short and the flag that changes it.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from specrag.errors import InvalidInputError
from specrag.pipeline.engines.ray_placement import replica_options
from specrag.retrieval.backends.shards.merge import ShardedSearcher
from specrag.retrieval.backends.shards.store import replayed_rows, sharded
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.http.monitoring import SearchShardsHealth
from specrag.service.run.options import ServiceOptions

__all__ = ["check_search_shards", "searching_on_shards", "shard_cpus", "shards_health"]

# The finest share of a CPU the automatic request gives (Ray counts in ten-thousandths).
_CPU_STEP = 0.01


def shard_cpus(options: ServiceOptions, cluster: Mapping[str, float]) -> float:
    """The CPUs each shard actor asks Ray for: ``--search-shard-cpus``, else one each when the
    ``cluster``'s CPUs hold them beside the engine replicas (one CPU each on a cluster without
    GPUs), else an equal share of the CPUs the replicas leave. InvalidInputError, before any
    actor starts, when Ray could never place them all (it would wait for ever)."""
    count = options.search_shards or 0
    total = float(cluster.get("CPU", 0.0))
    engines = options.replicas * float(replica_options(cluster).get("num_cpus", 0))
    left = total - engines
    wanted = options.search_shard_cpus
    if wanted is None:
        if left >= count:
            return 1.0
        wanted = math.floor(left / count / _CPU_STEP) * _CPU_STEP if left > 0 else 0.0
        if wanted <= 0:
            raise InvalidInputError(
                f"Ray cannot place {count} search shards: the cluster's {total:g} CPUs all go to the "
                f"{options.replicas} engine replica(s), one each (give --search-shard-cpus 0 to let the "
                "shards share their cores, fewer --replicas, or a larger cluster)"
            )
        return round(wanted, 4)
    if engines + count * wanted > total + 1e-9:
        fits = math.floor(left / count / _CPU_STEP) * _CPU_STEP if left > 0 else 0.0
        raise InvalidInputError(
            f"Ray cannot place {count} search shards at --search-shard-cpus {wanted:g}: with "
            f"{options.replicas} engine replica(s) at 1 CPU each they need {engines + count * wanted:g} "
            f"CPUs, the cluster has {total:g} (give --search-shard-cpus {fits:g} or less, fewer "
            "--search-shards or --replicas, or a larger cluster)"
        )
    return wanted


def check_search_shards(index: VectorIndex, count: int, directory: str) -> dict[str, Any]:
    """The searcher settings of ``index`` when it has ``count`` shards, else InvalidInputError
    saying what it has and how to build what was asked."""
    settings = index.searcher.settings
    if not sharded(settings):
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


def shards_health(remote: ShardedSearcher) -> list[dict[str, Any]]:
    """How each search shard actor of ``remote`` stands, for ``/health``
    (:meth:`specrag.retrieval.backends.shards.search_actors.RemoteShard.health`)."""
    return [health() for shard in remote.shards if callable(health := getattr(shard, "health", None))]


@contextlib.contextmanager
def searching_on_shards(index: VectorIndex, options: ServiceOptions) -> Iterator[SearchShardsHealth | None]:
    """Within the block, ``index`` searches through one Ray actor per shard
    (:meth:`VectorIndex.searching_through`), and the block is given how the actors stand, for
    ``/health``; nothing changes without ``options.search_shards`` (the block is given None). Ray
    is started here unless it runs already, and then also serves the engine replicas."""
    if options.search_shards is None:
        yield None
        return
    assert options.index_dir is not None, "the service options name the index directory with the shard count"
    settings = check_search_shards(index, options.search_shards, options.index_dir)
    import ray

    from specrag.retrieval.backends.shards.search_actors import search_shards

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=options.ray_address or None, include_dashboard=False, log_to_driver=False)
    added = replayed_rows(index.searcher)
    try:
        cpus = shard_cpus(options, ray.cluster_resources())
        with search_shards(Path(options.index_dir), settings, added=added or None, num_cpus=cpus) as remote:
            held = index.searcher.ntotal
            if remote.ntotal != held:
                raise InvalidInputError(
                    f"the index holds {held} rows, its shard files {remote.ntotal}: documents "
                    "were added to shards loaded in this process; rebuild it (`specrag index build`)"
                )
            with index.searching_through(remote):
                yield functools.partial(shards_health, remote)
    finally:
        if started_ray:
            ray.shutdown()
