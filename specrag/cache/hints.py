"""Text hints that keep answers faithful when the cache layer changes what the model sees.

Reordering documents for reuse hides the retriever's relevance ranking, so an *order hint* after
the documents restates it (RAGBoost §5.3). In a multi-turn session a document already given in
an earlier turn is not sent again: a *location hint* points the model to where it is in the
conversation (RAGBoost §6, ContextPilot Algorithm 3). Hints are text; the pipeline tokenizes them
and places them after the documents, where they cannot break a shared prefix. Labels name
documents by id, not position, so the document segments can carry the same label at ingest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specrag.cache.layout import DocId
from specrag.errors import InvalidInputError

__all__ = ["Dedup", "HintConfig", "order_hint", "split_repeated"]


@dataclass(frozen=True, slots=True)
class HintConfig:
    """Hint switches and wording; ``{label}``, ``{order}`` and ``{turn}`` are filled in."""

    order_hint: bool = True
    doc_label: str = "[Doc {doc_id}]"
    order_separator: str = " > "
    order_template: str = "Most relevant first, the documents rank: {order}. Answer using that priority."
    location_template: str = (
        "{label} was already given in turn {turn} of this conversation; use it from there."
    )

    def label(self, doc_id: DocId) -> str:
        return self.doc_label.format(doc_id=doc_id)


def order_hint(
    retrieval_order: Sequence[DocId], prompt_order: Sequence[DocId], config: HintConfig
) -> str | None:
    """The retrieval ranking as text, or None when switched off or when the order is unchanged."""
    if len(retrieval_order) != len(prompt_order) or set(retrieval_order) != set(prompt_order):
        raise InvalidInputError("the prompt order must be a permutation of the retrieval order")
    if not config.order_hint or list(retrieval_order) == list(prompt_order):
        return None
    ranking = config.order_separator.join(config.label(d) for d in retrieval_order)
    return config.order_template.format(order=ranking)


@dataclass(frozen=True, slots=True)
class Dedup:
    """A turn's documents split into those to send and those already in the conversation."""

    kept: tuple[DocId, ...]
    repeated: tuple[DocId, ...]
    hints: tuple[str, ...]

    def hint_text(self) -> str:
        return "\n".join(self.hints)


def split_repeated(first_given: Mapping[DocId, int], doc_ids: Sequence[DocId], config: HintConfig) -> Dedup:
    """Split a turn's documents into new ones and ones already given, with a location hint each.

    ``first_given`` maps every document still in the conversation to the turn that gave it. Pure:
    the caller records what was sent only once the turn is done, so a turn that fails or is
    abandoned changes nothing.
    """
    kept: list[DocId] = []
    repeated: list[DocId] = []
    hints: list[str] = []
    for doc_id in doc_ids:
        turn = first_given.get(doc_id)
        if turn is None:
            kept.append(doc_id)
        else:
            repeated.append(doc_id)
            hints.append(config.location_template.format(label=config.label(doc_id), turn=turn))
    return Dedup(tuple(kept), tuple(repeated), tuple(hints))
