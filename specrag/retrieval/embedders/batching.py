"""Texts in batches of similar length, for embedders that pad a batch to its longest text.

A contextual embedder runs every text of a batch through the model at the batch's longest
length; texts of similar length together waste the least work. A static embedder does not care,
and loses nothing by the order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

__all__ = ["length_sorted_batches"]


def length_sorted_batches(texts: Sequence[str], size: int) -> Iterator[list[int]]:
    """The rows of ``texts`` in batches of at most ``size``, shortest texts first."""
    order = sorted(range(len(texts)), key=lambda row: len(texts[row]))
    for start in range(0, len(order), size):
        yield order[start : start + size]
