"""The fixed text a model's chat template puts around specrag's parts of a prompt.

An instruction-tuned model answers well only in its own chat format; without it, it runs on past
the answer into an invented next question. But a RAG prompt must stay a sequence of stored token
segments (documents are never re-tokenized, or the prefix cache loses every block after the first
changed token). So the template is rendered once with placeholder contents and cut at them: what
lies around the placeholders is the frame, tokenized once and placed around the segments.

For ChatML (SmolLM2, Qwen) a first turn is::

    head:      <|im_start|>system\\n{system prompt}<|im_end|>\\n<|im_start|>user\\n
    segments:  {documents}{hint}{question}
    tail:      <|im_end|>\\n<|im_start|>assistant\\n

and a later turn continues the previous prompt and answer with ``turn_end`` (``<|im_end|>``, unless
the answer already ended with it) and ``next_user`` (``\\n<|im_start|>user\\n``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specrag.errors import ArtifactError

__all__ = ["ChatFrame", "Messages", "RenderChat", "chat_frame"]

Messages = list[dict[str, str]]
RenderChat = Callable[[Messages], str]
"""Renders messages with the model's chat template, the assistant's turn opened at the end."""

_SLOTS = ("SPECRAG_SLOT_USER_1", "SPECRAG_SLOT_ASSISTANT", "SPECRAG_SLOT_USER_2")


@dataclass(frozen=True)
class ChatFrame:
    """The template's text around the first user turn, and between an answer and the next turn."""

    head: str
    """Before the first user turn's content: the system turn and the user turn's opening."""
    tail: str
    """After a user turn's content: its close and the assistant turn's opening."""
    turn_end: str
    """What closes an answer (the model's end-of-turn token, which it usually generates itself)."""
    next_user: str
    """What opens a later user turn after a closed answer."""


def _cut(rendered: str, slot: str) -> tuple[str, str]:
    before, found, after = rendered.partition(slot)
    if not found or slot in after:
        raise ArtifactError(f"the chat template does not render each message's content exactly once ({slot})")
    return before, after


def chat_frame(render: RenderChat, system_prompt: str, end_of_turn: str | None) -> ChatFrame:
    """The frame of ``render``'s template for ``system_prompt``.

    ``end_of_turn`` is the tokenizer's end-of-sequence text: where the text between an answer and
    the next user turn starts with it, it is split off as :attr:`ChatFrame.turn_end`.
    """
    user, assistant, later_user = _SLOTS
    system = {"role": "system", "content": system_prompt}
    head, tail = _cut(render([system, {"role": "user", "content": user}]), user)
    two_turns = render(
        [
            system,
            {"role": "user", "content": user},
            {"role": "assistant", "content": assistant},
            {"role": "user", "content": later_user},
        ]
    )
    first, rest = _cut(two_turns, assistant)
    between, _ = _cut(rest, later_user)
    if first != head + user + tail:
        raise ArtifactError("the chat template renders the first turn differently once an answer follows")
    turn_end = end_of_turn if end_of_turn and between.startswith(end_of_turn) else ""
    return ChatFrame(head=head, tail=tail, turn_end=turn_end, next_user=between[len(turn_end) :])
