"""Document KV tiers: which of a ``turbo`` request's documents are loaded and which prefilled fresh.

Through vLLM's KV-connector API the loaded KV must be a prefix of the prompt, so the documents
prefilled fresh go after the loaded ones. The fresh ones are the top-ranked: placed nearest the
question, they attend to everything before them (the loaded documents included), which a loaded
document, computed alone or after the system prompt only, never did. Retrieval's top documents are
the likeliest to hold the answer, so they are the ones worth computing exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from specrag.cache.layout import PromptLayout
from specrag.pipeline.engines.protocol import Sampling

__all__ = ["document_kv_sampling", "fresh_last"]


def fresh_last(order: Sequence[int], ranked: Sequence[int], fresh: int) -> list[int]:
    """``order`` with the ``fresh`` best-ranked of ``ranked`` moved to its end, in rank order;
    the others keep their order (the one the ordering policy chose for them)."""
    top = [row for row in ranked[:fresh] if row in order]
    kept = [row for row in order if row not in top]
    return [*kept, *top]


def document_kv_sampling(
    sampling: Sampling, layout: PromptLayout, fresh: int, *, after_system: bool
) -> Sampling:
    """``sampling`` told which spans of ``layout`` to load: the system prompt and every document but
    the last ``fresh``; with ``after_system``, the documents as stored after the system prompt."""
    spans = layout.stored_spans(fresh)
    system_end = layout.segments[0].end if layout.segments[0].kind == "system" else 0
    prefix = system_end if after_system and spans else 0
    return replace(sampling, document_kv=spans, document_kv_prefix=prefix)
