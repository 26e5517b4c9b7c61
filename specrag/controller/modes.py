"""Which optimisations a request uses: the configurations every experiment compares.

``serial`` is plain RAG over an engine with automatic prefix caching (search, then prefill, documents
in retrieval order). Each other mode adds one optimisation to it; ``all`` combines them.
"""

from __future__ import annotations

from dataclasses import dataclass

from specrag.errors import InvalidInputError, echo


@dataclass(frozen=True)
class Mode:
    """A set of optimisation switches with the name experiments report it under."""

    name: str
    warmup: bool
    ordering: bool
    speculation: bool


MODES: dict[str, Mode] = {
    mode.name: mode
    for mode in (
        Mode("serial", warmup=False, ordering=False, speculation=False),
        Mode("warmup", warmup=True, ordering=False, speculation=False),
        Mode("ordering", warmup=False, ordering=True, speculation=False),
        Mode("speculation", warmup=False, ordering=False, speculation=True),
        Mode("all", warmup=True, ordering=True, speculation=True),
    )
}
MODE_NAMES: tuple[str, ...] = tuple(MODES)


# How a request's documents get their KV: prefilled with the prompt (``full``), or loaded from the
# engine's document KV store, each computed alone (``turbo``, TurboRAG; docs/turbo.md).
DOCUMENT_KV_CHOICES: tuple[str, ...] = ("full", "turbo")


def check_document_kv(name: str) -> str:
    """``name`` if it is a document-KV choice; :class:`InvalidInputError` listing them otherwise."""
    if name not in DOCUMENT_KV_CHOICES:
        raise InvalidInputError(f"unknown document_kv {echo(name)}; known: {', '.join(DOCUMENT_KV_CHOICES)}")
    return name


def get_mode(name: str) -> Mode:
    """The mode called ``name``; an unknown name raises :class:`InvalidInputError` listing the known ones."""
    try:
        return MODES[name]
    except KeyError:
        raise InvalidInputError(f"unknown mode {echo(name)}; known: {', '.join(MODE_NAMES)}") from None
