"""One spelling for every way a text can be written, before either retrieval channel sees it.

A question typed on a phone, pasted from a PDF or a chat window reaches the service as fullwidth
letters (``ｗｈａｔ``), with zero-width spaces or soft hyphens inside words, or in decomposed
Unicode (``a`` + a combining umlaut rather than ``ä``). The dense embedder and BM25 both read
such words as unknown ones, so the same question retrieved other documents. Questions and
corpus text go through :func:`normalize_text` alike (at index build and at query time): format
characters (Unicode category Cf: zero-width spaces and joiners, soft hyphens, byte-order marks,
bidirectional marks) are removed, then NFKC folds compatibility forms and composes accents, then
runs of whitespace become one space. The document store keeps the original text: the model reads
what the corpus says.

Changing these rules changes what an index is built from: bump ``index_store.VERSION`` with them.
"""

from __future__ import annotations

import unicodedata

__all__ = ["normalize_text"]


def normalize_text(text: str) -> str:
    """``text`` without format characters, in NFKC, its whitespace runs collapsed to one space."""
    if not text.isascii():  # ASCII has no format characters and is its own NFKC
        text = "".join(char for char in text if unicodedata.category(char) != "Cf")
        text = unicodedata.normalize("NFKC", text)
    return " ".join(text.split())
