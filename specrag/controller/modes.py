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


def get_mode(name: str) -> Mode:
    """The mode called ``name``; an unknown name raises :class:`InvalidInputError` listing the known ones."""
    return MODES[check_choice("mode", name, MODE_NAMES)]
