"""Which optimisations a request uses: the configurations every experiment compares.

``serial`` is plain RAG over an engine with automatic prefix caching (search, then prefill, documents
in retrieval order). Each other mode adds one optimisation to it; ``all`` combines them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from specrag.errors import check_choice

__all__ = ["MODES", "MODE_NAMES", "DocumentKv", "DocumentKvVariant", "Mode", "ModeName", "get_mode"]


@dataclass(frozen=True)
class Mode:
    """A set of optimisation switches with the name experiments report it under."""

    name: ModeName
    warmup: bool
    ordering: bool
    speculation: bool


class ModeName(enum.StrEnum):
    """The modes by the names experiments report them under (and requests ask for)."""

    SERIAL = "serial"
    WARMUP = "warmup"
    ORDERING = "ordering"
    SPECULATION = "speculation"
    ALL = "all"


MODE_NAMES: tuple[ModeName, ...] = tuple(ModeName)
MODES: dict[ModeName, Mode] = {
    mode.name: mode
    for mode in (
        Mode(ModeName.SERIAL, warmup=False, ordering=False, speculation=False),
        Mode(ModeName.WARMUP, warmup=True, ordering=False, speculation=False),
        Mode(ModeName.ORDERING, warmup=False, ordering=True, speculation=False),
        Mode(ModeName.SPECULATION, warmup=False, ordering=False, speculation=True),
        Mode(ModeName.ALL, warmup=True, ordering=True, speculation=True),
    )
}


class DocumentKv(enum.StrEnum):
    """How a request's documents get their KV: prefilled with the prompt (``full``), or loaded from
    the engine's document KV store, each computed alone (``turbo``, TurboRAG; docs/turbo.md)."""

    FULL = "full"
    TURBO = "turbo"


class DocumentKvVariant(enum.StrEnum):
    """How a ``turbo`` request's stored document KV was computed: each document alone from position
    0 (``alone``, TurboRAG: each grows its own attention sink), or after the system prompt
    (``after-system``, APE's shared prefix: each document attends to the prompt's real start)."""

    ALONE = "alone"
    AFTER_SYSTEM = "after-system"


def get_mode(name: str) -> Mode:
    """The mode called ``name``; an unknown name raises :class:`InvalidInputError` listing the known ones."""
    return MODES[check_choice("mode", name, ModeName)]
