"""What an engine replica asks Ray for; the placement itself, bounded and explained when Ray cannot
place an actor, is :mod:`specrag.ray_placement`'s (the search shards place theirs there too)."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["replica_options"]


def replica_options(cluster: Mapping[str, float]) -> dict[str, float]:
    """What one engine replica asks Ray for: a GPU when the cluster has GPUs, otherwise one CPU."""
    return {"num_gpus": 1} if cluster.get("GPU", 0) >= 1 else {"num_cpus": 1}
