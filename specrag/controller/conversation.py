"""The prompt of a later turn of a conversation, kept inside the model's context.

A conversation's history only grows: at k = 10 and 64 output tokens a few turns fill an 8k
context. Like chat servers, the oldest turns leave the context first; the system prompt and the
current turn's documents and question always stay. A document given by a turn that left is no
longer in what the model sees, so it is sent again instead of being pointed to. Building the
prompt changes nothing in the session: the turns kept are recorded only when the turn is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specrag.cache.hints import HintConfig, split_repeated
from specrag.cache.layout import PromptLayout
from specrag.controller.sessions import Session, Turn
from specrag.pipeline.store.prompt import PromptBuilder

__all__ = ["TurnPrompt", "TurnPrompts"]


@dataclass(frozen=True)
class TurnPrompt:
    """A later turn's prompt, the context turns it continues and those it left out."""

    layout: PromptLayout
    kept: tuple[Turn, ...]
    dropped: tuple[Turn, ...]

    def predicted_cached_tokens(self, session: Session, block_size: int) -> int:
        """What the prefix cache should serve: the history it continues, in whole blocks.

        Once turns are dropped the prompt no longer continues the cached history, only the
        system prompt.
        """
        continued = len(session.history) if not self.dropped else len(session.base)
        return continued // block_size * block_size


@dataclass(frozen=True)
class TurnPrompts:
    """Builds later turns' prompts with one prompt builder and one hint wording."""

    builder: PromptBuilder
    hints: HintConfig

    def build(
        self, session: Session, rows: Sequence[int], question_token_ids: Sequence[int], budget_tokens: int
    ) -> TurnPrompt:
        """The prompt continuing the newest context turns that leave it within ``budget_tokens``.

        Turns are dropped oldest first; with none left the prompt starts from the system prompt,
        and if that is still too long the caller's length check reports it.
        """

        def keeping(kept: tuple[Turn, ...]) -> PromptLayout:
            split = split_repeated(session.first_given(kept), rows, self.hints)
            return self.builder.build_with_question_tokens(
                [int(doc) for doc in split.kept],
                question_token_ids,
                split.hint_text() or None,
                session.history_of(kept) if kept else None,
            )

        context, first = session.context, 0
        layout = keeping(context)
        while len(layout.token_ids) > budget_tokens and first < len(context):
            first += 1
            layout = keeping(context[first:])
        return TurnPrompt(layout, context[first:], context[:first])
