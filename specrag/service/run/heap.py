"""The heap a service starts with, kept out of the garbage collector's full collections.

A started service holds several hundred thousand objects that live as long as it does: the
modules of torch, transformers and vLLM's event classes, the embedder, the index and the
corpus. CPython's full (oldest-generation) collection walks every one of them, and runs on
whichever thread allocated when its threshold was reached: on the event loop, inside a query's
ordering or its stream, every few hundred answers, stopping every answer in flight for as long
as the walk takes (docs/capacity.md, "Profile", gives the measured pause). ``gc.freeze`` moves
the objects alive at the end of the start into the permanent generation, which collections skip;
what the service makes afterwards (its trees, its queries) is collected as before. vLLM's own
engine core and server freeze theirs the same way once started
(``vllm.utils.gc_utils.freeze_gc_heap``).

One collection first, so that the start's own garbage is freed rather than frozen; on exit the
heap is unfrozen, so that what the service held can be collected again in a process that goes
on (a test session opening services one after another).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["frozen_heap"]


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the objects alive now (after one full collection) while the block runs."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
