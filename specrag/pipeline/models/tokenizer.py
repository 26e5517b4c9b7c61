"""The model's tokenizer, loaded from any Hugging Face model directory, plus a stable fingerprint.

The fingerprint names the document store built with this tokenizer: token IDs from one tokenizer
are meaningless to another, so a store is only reused when the fingerprints match.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from specrag.errors import ArtifactError
from specrag.pipeline.models.chat_format import ChatFrame, Messages, chat_frame

__all__ = ["Tokenizer", "tokenizer_fingerprint"]

# Files whose content defines how text becomes token IDs, in any HF model directory.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")


def tokenizer_fingerprint(model_dir: Path) -> str:
    """Short SHA-256 over the tokenizer files present in ``model_dir``."""
    digest = hashlib.sha256()
    found = False
    for name in _TOKENIZER_FILES:
        path = model_dir / name
        if path.is_file():
            found = True
            digest.update(name.encode())
            digest.update(path.read_bytes())
    if not found:
        raise ArtifactError(f"no tokenizer files in {model_dir} (looked for {', '.join(_TOKENIZER_FILES)})")
    return digest.hexdigest()[:16]


def _text_encoder(tokenizer: Any) -> Any:
    """A fast tokenizer's own Rust tokenizer, set to encode special tokens' spellings as text.

    ``encode`` runs on the event loop for every question: through transformers it costs several
    times the encoding (its batch call's Python and, under load, the Rust thread pool's
    wake-ups). transformers' ``split_special_tokens`` sets this flag on its shared tokenizer for
    the call, so a copy of our own with the flag set, no truncation and no padding gives the
    same ids; None for a slow tokenizer, which keeps transformers' path.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    own = type(backend).from_str(backend.to_str())
    own.encode_special_tokens = True
    own.no_truncation()
    own.no_padding()
    return own


class Tokenizer:
    """Encode without special tokens (prompts are assembled from segments), decode for display."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        try:
            self._tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError) as error:
            raise ArtifactError(f"cannot load a tokenizer from {model_dir}: {error}") from error
        self.fingerprint = tokenizer_fingerprint(model_dir)
        self.model_dir = model_dir
        self._text_encoder = _text_encoder(self._tokenizer)

    @property
    def pad_token_id(self) -> int:
        """A token to pad segments to block multiples with.

        Padding sits between documents, inside what the model reads, so a chat model must not see
        its pad token there: that is usually its end-of-turn token, which tells it the question is
        over. One newline token reads as a blank line; a tokenizer without one pads with its pad
        token, else EOS, else 0.
        """
        newline = self.encode("\n")
        if len(newline) == 1:
            return newline[0]
        for candidate in (self._tokenizer.pad_token_id, self._tokenizer.eos_token_id):
            if candidate is not None:
                return int(candidate)
        return 0

    def chat_frame(self, system_prompt: str) -> ChatFrame | None:
        """The chat template's frame around ``system_prompt``, or None for a model without one."""
        if not getattr(self._tokenizer, "chat_template", None):
            return None

        def render(messages: Messages) -> str:
            return str(
                self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            )

        return chat_frame(render, system_prompt, self._tokenizer.eos_token)

    def encode(self, text: str) -> list[int]:
        """Text as text: a special token's spelling in it (``<|im_end|>``) stays characters, so a
        question or a passage cannot close a chat turn or open one of its own."""
        if self._text_encoder is not None:
            return list(self._text_encoder.encode(text, add_special_tokens=False).ids)
        return list(self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def encode_markup(self, text: str) -> list[int]:
        """Text the chat template wrote: its special tokens' spellings become those tokens."""
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encoded = self._tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return [list(ids) for ids in encoded]

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))
