"""The progress bar every build ticks as its passages are embedded, whichever embedder does it.

Its own module so that an embedder can tick it without importing the embedders' registry back
(:mod:`specrag.retrieval.progress` imports that registry's protocol).
"""

from __future__ import annotations

from tqdm import tqdm

__all__ = ["embedding_bar"]


def embedding_bar(total: int, show: bool) -> tqdm:
    """A bar of ``total`` passages, drawn on stderr when ``show``."""
    return tqdm(total=total, desc="embedding passages", unit="doc", disable=not show)
