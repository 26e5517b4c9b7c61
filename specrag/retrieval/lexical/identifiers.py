"""The code identifiers a question names (``FTP.sendeprt``, ``read_bytes``, ``CheckList``).

A question about code usually turns on one name, and that name is the rarest, most telling word
in it; yet BM25 weighs it as one term among the question's ordinary words ("which", "module",
"defined", "function"), and several of those, each common but present in long passages, outscore
it together. The dense channel does worse: an embedding of a made-up word is close to nothing in
particular. So a question that names an identifier is a lexical question, and hybrid search
treats it so (:class:`~specrag.retrieval.lexical.fusion.FusionConfig` ``identifier_weight``): the
identifier's terms count more in BM25 and the lexical ranking counts more in the fusion.

What counts as an identifier is what only code spells that way: a back-quoted span, a word with
an underscore, a dotted name, a word whose case changes inside it (``CheckList``,
``HTTPServer``), or a call (``open()``). A capitalised first word of a sentence is not one.
"""

from __future__ import annotations

import re

from specrag.retrieval.text import normalize_text

__all__ = ["named_identifiers"]

_IDENTIFIER = re.compile(
    r"(?<!`)`(?P<quoted>[^`\s](?:[^`]*[^`\s])?)`(?!`)"  # a back-quoted span
    r"|(?P<word>"
    r"(?=[\w.]*\w\w)[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+"  # a dotted name (not "e.g")
    r"|\w*[A-Za-z]\w*_\w*|\w*_\w*[A-Za-z]\w*"  # a word with an underscore
    r"|\w*[a-z][A-Z]\w*|\w*[A-Z][A-Z][a-z][a-z]\w*"  # a case change inside a word (not "IDs")
    r"|[A-Za-z_]\w*(?=\(\))"  # a call
    r")"
)


def named_identifiers(text: str) -> list[str]:
    """The identifiers ``text`` names, in order, each occurrence once (back quotes removed);
    read from the text as :func:`~specrag.retrieval.text.normalize_text` writes it, so a
    zero-width space or a fullwidth letter does not hide one."""
    return [match["quoted"] or match["word"] for match in _IDENTIFIER.finditer(normalize_text(text))]
