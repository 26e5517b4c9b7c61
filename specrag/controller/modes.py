"""Which optimisations a request uses: the configurations every experiment compares.

``serial`` is plain RAG over an engine with automatic prefix caching (search, then prefill, documents
in retrieval order). Each other mode adds one optimisation to it; ``all`` combines them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from specrag.errors import check_choice


@dataclass(frozen=True)
class Mode:
    """A set of optimisation switches with the name experiments report it under."""

    name: ModeName
    warmup: bool
    ordering: bool
    speculation: bool


ModeName = Literal["serial", "warmup", "ordering", "speculation", "all"]
MODE_NAMES: tuple[ModeName, ...] = get_args(ModeName)
MODES: dict[ModeName, Mode] = {
    mode.name: mode
    for mode in (
        Mode("serial", warmup=False, ordering=False, speculation=False),
        Mode("warmup", warmup=True, ordering=False, speculation=False),
        Mode("ordering", warmup=False, ordering=True, speculation=False),
        Mode("speculation", warmup=False, ordering=False, speculation=True),
        Mode("all", warmup=True, ordering=True, speculation=True),
    )
}


# How a request's documents get their KV: prefilled with the prompt (``full``), or loaded from the
# engine's document KV store, each computed alone (``turbo``, TurboRAG; docs/turbo.md).
DocumentKv = Literal["full", "turbo"]
DOCUMENT_KV_CHOICES: tuple[DocumentKv, ...] = get_args(DocumentKv)


def check_document_kv(name: str) -> DocumentKv:
    """``name`` if it is a document-KV choice; :class:`InvalidInputError` listing them otherwise."""
    return check_choice("document_kv", name, DOCUMENT_KV_CHOICES)


def get_mode(name: str) -> Mode:
    """The mode called ``name``; an unknown name raises :class:`InvalidInputError` listing the known ones."""
    return MODES[check_choice("mode", name, MODE_NAMES)]
