"""Placing an actor on Ray within a bound, and saying what it waits for when Ray cannot.

Ray keeps an actor whose resources no node has free pending for ever, and says so only in its own
logs: a service that waited for it would say ``starting`` for ever. So every actor specrag starts
(an engine replica, a search shard) is first waited for until it is *placed*, its worker running
(``__ray_ready__``, before its own slow start: a model or a shard to load), for at most
:data:`PLACEMENT_WAIT_S`; past that the error names the actor, what it asks for, what the cluster
has free of it, and the flag that changes it (:func:`unplaced`).

A leaf module beside the packages: the engines (:mod:`specrag.pipeline.engines.ray_engine`) and the
search shards (:mod:`specrag.retrieval.backends.shards.search_actors`) both place actors, and
retrieval imports nothing of the pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["PLACEMENT_WAIT_S", "ray_resources", "unplaced"]

# How long an actor may wait to be placed and its worker started (a worker process starts in
# seconds; on a loaded machine in tens of seconds).
PLACEMENT_WAIT_S = 60.0

# Actor options and the cluster resources they ask for.
_RESOURCE_OF_OPTION = {"num_cpus": "CPU", "num_gpus": "GPU"}


def ray_resources(options: Mapping[str, float]) -> dict[str, float]:
    """The cluster resources actor ``options`` (``num_cpus``, ``num_gpus``) ask for."""
    return {_RESOURCE_OF_OPTION[name]: amount for name, amount in options.items() if amount}


def unplaced(what: str, options: Mapping[str, float], waited_s: float, fix: str) -> str:
    """Why ``what`` (an actor started with resource ``options``) is not running after
    ``waited_s``: the resource the cluster lacks, or, when it has them, a worker slow to start;
    ``fix`` names the flags that change the request."""
    import ray  # the extra: this module is imported by a service that may have no Ray

    total, free = ray.cluster_resources(), ray.available_resources()
    asks = ray_resources(options)
    short = {name: amount for name, amount in asks.items() if free.get(name, 0.0) < amount}
    if not short:
        return (
            f"{what} was not running within {waited_s:g}s although the cluster has the "
            f"{_listed(asks)} it asks for free: its worker process did not start (a machine too busy?)"
        )
    lacking = "; ".join(
        f"it asks for {amount:g} {name}, the cluster has {free.get(name, 0.0):g} of "
        f"{total.get(name, 0.0):g} free"
        for name, amount in short.items()
    )
    return f"{what} could not be placed within {waited_s:g}s: {lacking} ({fix})"


def _listed(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in resources.items()) or "no resources"
