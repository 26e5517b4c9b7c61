"""bench.capacity's CPU meters charge each part exclusively, the garbage collector's passes to
``gc`` rather than to the function that happened to allocate when a collection started."""

from __future__ import annotations

import gc
from types import SimpleNamespace

from bench.capacity.meters import CpuMeters


def test_a_collection_inside_a_metered_function_is_charged_to_gc_not_to_the_function() -> None:
    meters = CpuMeters()
    heap = [[index] for index in range(300_000)]  # objects a full collection walks
    place = SimpleNamespace(documents=gc.collect)
    meters.wrap(place, "documents", "ordering")
    try:
        for _ in range(3):
            place.documents()
    finally:
        gc.callbacks.remove(meters._collecting)
    assert len(heap) == 300_000
    assert meters.seconds["gc"] > 10 * meters.seconds["ordering"]
