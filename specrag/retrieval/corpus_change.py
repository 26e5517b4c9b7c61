"""What changed between the corpus the artefacts were built from and the corpus given now.

A corpus file cut short (a copy interrupted at a line boundary, an edit gone wrong) still loads;
rebuilding the store and index from it would quietly drop every missing passage from all answers.
So before anything is rebuilt the new corpus is compared with what the built artefacts hold:
every change is said at WARNING (passages before and after, added, removed), and a corpus that
lost passages is refused unless the caller accepts the change on purpose
(``--accept-corpus-change``). The old artefacts stay in place, and are served, until new ones
are complete (:mod:`specrag.atomic`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from specrag.errors import ArtifactError
from specrag.retrieval.corpus import Passage

__all__ = ["ACCEPT_FLAG", "CorpusChange", "CorpusShrunkError", "check_corpus_change"]

logger = logging.getLogger(__name__)

ACCEPT_FLAG = "--accept-corpus-change"
# How many removed passage ids a message names before it says "and N more".
_NAMED_IDS = 5


class CorpusShrunkError(ArtifactError):
    """The corpus lost passages since the artefacts were built, and the change was not accepted."""


@dataclass(frozen=True)
class CorpusChange:
    """Passage counts before and after, and the ids added and removed (``removed_ids`` in order)."""

    before: int
    after: int
    added: int
    removed_ids: tuple[str, ...]

    @classmethod
    def between(cls, built_ids: Sequence[str], passages: Sequence[Passage]) -> CorpusChange:
        now = {passage.id for passage in passages}
        built = set(built_ids)
        return cls(
            before=len(built_ids),
            after=len(passages),
            added=len(now - built),
            removed_ids=tuple(found for found in built_ids if found not in now),
        )

    @property
    def removed(self) -> int:
        return len(self.removed_ids)

    def describe(self) -> str:
        text = f"{self.before} passages before, {self.after} now: {self.added} added, {self.removed} removed"
        if self.removed_ids:
            named = ", ".join(repr(found) for found in self.removed_ids[:_NAMED_IDS])
            more = self.removed - _NAMED_IDS
            text += f" ({named}{f' and {more} more' if more > 0 else ''})"
        if not self.added and not self.removed:
            text += " (the same ids, in another order or with other texts)"
        return text


def check_corpus_change(
    built: str, built_ids: Sequence[str], passages: Sequence[Passage], accept: bool
) -> CorpusChange | None:
    """Compare ``passages`` with the ids the artefact ``built`` was made from.

    Returns None when they are the same passages in the same order (texts are the caller's to
    compare); else says the change at WARNING and returns it, or, when passages were lost and the
    change is not accepted, raises :class:`CorpusShrunkError` saying what to run.
    """
    if list(built_ids) == [passage.id for passage in passages]:
        return None
    change = CorpusChange.between(built_ids, passages)
    if change.removed and not accept:
        raise CorpusShrunkError(
            f"the corpus lost passages since {built} was built: {change.describe()}. The artefacts built "
            f"from the previous corpus are kept and nothing was rebuilt; if the new corpus is meant, run "
            f"again with {ACCEPT_FLAG} (or `specrag prepare {ACCEPT_FLAG}`)"
        )
    logger.warning(
        "the corpus changed since %s was built: %s; building new artefacts beside the old ones",
        built,
        change.describe(),
    )
    return change
