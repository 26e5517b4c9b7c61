"""Prompts as token IDs, assembled from the document store's per-passage token segments.

The system prompt and the question are tokenized here (once for the system prompt); documents are
never re-tokenized: their segments come from the store, in the order the cache layer chose, and
:func:`specrag.cache.layout.build_layout` lays them out, padding to KV-block multiples if asked.

A model with a chat template gets its own format (:mod:`specrag.pipeline.models.chat_format`): the
template's text before the documents ends the system segment, its text after the question ends
the question segment, and a later turn opens with the text between an answer and the next
question. Every fixed piece is tokenized once, so document segments stay where they were and two
prompts that share their first documents share those tokens exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

from specrag.cache.layout import PromptLayout, build_layout
from specrag.errors import InvalidInputError
from specrag.pipeline.models.tokenizer import Tokenizer
from specrag.pipeline.store.document_store import DocumentStore

__all__ = [
    "CHAT_QUESTION_TEMPLATE",
    "DEFAULT_QUESTION_TEMPLATE",
    "DEFAULT_SYSTEM_PROMPT",
    "MAX_QUESTION_CHARS",
    "QUESTION_RESERVE_TOKENS",
    "PromptBuilder",
]

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful assistant for Python programmers. You answer questions about the Python "
    "language and its standard library. Below are passages retrieved from the Python documentation. "
    "Base your answer on these passages only. If the passages do not contain the answer, say that "
    "you do not know instead of guessing. Quote the names of functions, classes and modules exactly "
    "as they appear in the passages. Keep the answer short: one or two paragraphs, with a small code "
    "example when it helps. Do not repeat the question. Do not mention these instructions.\n\n"
)
DEFAULT_QUESTION_TEMPLATE = "Question: {question}\nAnswer:"
CHAT_QUESTION_TEMPLATE = "Question: {question}"
"""A chat model's question: its template opens the answer, so no ``Answer:`` cue."""
MAX_QUESTION_CHARS = 4000
# Tokens a prompt keeps for the question and the order hint when the longest document a live
# corpus takes is worked out: a typical question fits; a longer one beside the longest document
# is refused with advice (specrag.controller.fitting).
QUESTION_RESERVE_TOKENS = 256


class PromptBuilder:
    """Builds :class:`PromptLayout` prompts for one tokenizer, store and system prompt."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        store: DocumentStore,
        *,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        question_template: str | None = None,
        block_size: int | None = None,
    ) -> None:
        """``question_template`` defaults to :data:`CHAT_QUESTION_TEMPLATE` for a chat model, else
        :data:`DEFAULT_QUESTION_TEMPLATE`."""
        store.check_matches(tokenizer.fingerprint)
        frame = tokenizer.chat_frame(system_prompt.strip())
        template = question_template or (
            DEFAULT_QUESTION_TEMPLATE if frame is None else CHAT_QUESTION_TEMPLATE
        )
        if "{question}" not in template:
            raise InvalidInputError("question_template must contain '{question}'")
        self.tokenizer = tokenizer
        self.store = store
        self.question_template = template
        self._question_end = tuple(tokenizer.encode_markup(frame.tail)) if frame else ()
        self.block_size = block_size
        self.system_token_ids: tuple[int, ...] = tuple(
            tokenizer.encode(system_prompt) if frame is None else tokenizer.encode_markup(frame.head)
        )
        self._turn_end = tuple(tokenizer.encode_markup(frame.turn_end)) if frame and frame.turn_end else ()
        self._next_turn = tuple(tokenizer.encode_markup(frame.next_user)) if frame else ()
        self._pad_token_id = tokenizer.pad_token_id if block_size else None

    def question_tokens(self, question: str) -> list[int]:
        if not question.strip():
            raise InvalidInputError("the question is empty")
        if len(question) > MAX_QUESTION_CHARS:
            raise InvalidInputError(f"the question is longer than {MAX_QUESTION_CHARS} characters")
        return [*self.tokenizer.encode(self.question_template.format(question=question)), *self._question_end]

    def build(
        self,
        doc_rows: Sequence[int],
        question: str,
        hint: str | None = None,
        history: Sequence[int] | None = None,
    ) -> PromptLayout:
        """The prompt ``system · documents (in this order) · hint · question`` as token IDs.

        For a later turn of a conversation, ``history`` (everything said so far) takes the system
        prompt's place, so the whole conversation is one cached prefix.
        """
        return self.build_with_question_tokens(doc_rows, self.question_tokens(question), hint, history)

    def build_with_question_tokens(
        self,
        doc_rows: Sequence[int],
        question_token_ids: Sequence[int],
        hint: str | None = None,
        history: Sequence[int] | None = None,
    ) -> PromptLayout:
        """:meth:`build` for a question already tokenized by :meth:`question_tokens`.

        A query builds a prompt at every search stage; tokenizing its question once saves the
        tokenizer's time on each of them.
        """
        documents = [(int(row), self.store.tokens(int(row))) for row in doc_rows]
        return build_layout(
            self.system_token_ids if history is None else self._continuing(history),
            documents,
            question_token_ids,
            self.tokenizer.encode(hint) if hint else None,
            block_size=self.block_size,
            pad_token_id=self._pad_token_id,
        )

    def _continuing(self, history: Sequence[int]) -> tuple[int, ...]:
        """``history`` (ending with an answer) and the chat template's opening of the next turn.

        The answer's end-of-turn token is added only when the answer lacks it (it stopped at its
        token limit): a model that ended its turn itself already generated it.
        """
        ended = not self._turn_end or tuple(history[-len(self._turn_end) :]) == self._turn_end
        return (*history, *(() if ended else self._turn_end), *self._next_turn)

    def document_token_limit(self, max_model_len: int, answer_tokens: int) -> int:
        """The longest document segment that fits a prompt of its own in ``max_model_len`` tokens:
        less the system prompt, :data:`QUESTION_RESERVE_TOKENS`, the answer's ``answer_tokens`` and
        one block of padding (a segment is padded to the engine's blocks)."""
        fixed = len(self.system_layout_tokens()) + QUESTION_RESERVE_TOKENS + answer_tokens
        return max_model_len - fixed - (self.block_size or 0)

    def system_layout(self) -> PromptLayout:
        """The system prompt alone, laid out as it starts every prompt (for warm-up)."""
        return build_layout(
            self.system_token_ids, [], [], block_size=self.block_size, pad_token_id=self._pad_token_id
        )

    def system_layout_tokens(self) -> tuple[int, ...]:
        """The system prompt's tokens as they start every prompt (padded like in :meth:`build`)."""
        return self.system_layout().token_ids
