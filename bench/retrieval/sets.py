"""Real, offline retrieval evaluation sets for ``bench.retrieval``: corpus and queries as JSONL.

Two sets of different kinds, so that no setting is tuned to one of them:

- ``manpages``: the Linux manual pages of Debian's ``manpages`` and ``manpages-dev`` packages
  (``apt-get install -y manpages manpages-dev``). Each page's NAME line gives the query (its
  description only, without the names it documents, e.g. "open and possibly create a file"), and
  the rest of the page, split into ~180-word passages ``man2/open#0``, ``man2/open#1``, ... is the
  document ``man2/open``. Long documents, terse queries.
- ``pydoc``: the standard library's function and class docstrings. Each docstring's summary line
  is the query; the rest of the docstring, titled with the qualified name, is one short document.
- ``scale``: the ``pydoc`` set among distractors up to ``--documents`` (default 60,000) short
  documents, windows of 30-90 consecutive words of the manual pages: the build time and recall
  of a corpus of the size the issue's targets name.

The roff source is reduced to text by a small stripper (macros dropped, font and character
escapes removed): enough for retrieval, and it needs neither ``man`` nor ``groff``. The data is
never committed: this script rebuilds it in a few seconds.

Usage: ``python -m bench.retrieval.sets manpages --out DIR`` (writes ``DIR/corpus.jsonl`` and
``DIR/queries.jsonl``), then ``python -m bench.retrieval --corpus DIR/corpus.jsonl --queries
DIR/queries.jsonl``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrag.atomic import atomic_write_text
from specrag.retrieval.corpus import Passage, split_text, stdlib_docstrings

MAN_PACKAGES = ("manpages", "manpages-dev")
# Queries shorter than this many words say too little to name one document.
MIN_QUERY_WORDS = 3
MIN_DOCUMENT_WORDS = 20
# Macros whose arguments are text (font changes); every other request line is layout.
_TEXT_MACROS = frozenset({"B", "I", "BR", "RB", "IR", "RI", "BI", "IB", "SM", "SB", "IP", "TP", "UR", "MT"})
_ALTERNATING = frozenset({"BR", "RB", "IR", "RI", "BI", "IB"})
_ESCAPES = [
    (re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""),  # font changes
    (re.compile(r"\\s[+-]?\d"), ""),  # size changes
    (re.compile(r"\\\*(\[[^\]]*\]|\(..|.)"), ""),  # strings
    (re.compile(r"\\\((em|en|hy)"), "-"),
    (re.compile(r"\\\((aq|cq|oq)"), "'"),
    (re.compile(r"\\\((dq|lq|rq)"), '"'),
    (re.compile(r"\\\(..|\\\[[^\]]*\]"), " "),  # other special characters
    (re.compile(r"\\[-]"), "-"),
    (re.compile(r"\\[e\\]"), "\\\\"),
    (re.compile(r"\\[&|^%:)c]"), ""),
    (re.compile(r"\\[ ~0]"), " "),
]


@dataclass(frozen=True)
class EvaluationSet:
    passages: list[Passage]
    queries: list[dict[str, str]]


def roff_to_text(line: str) -> str:
    """One roff text line with its escapes removed."""
    for pattern, replacement in _ESCAPES:
        line = pattern.sub(replacement, line)
    return line


def _macro_text(name: str, arguments: str) -> str:
    words = [w.strip('"') for w in re.findall(r'"[^"]*"|\S+', arguments)]
    return roff_to_text(("" if name in _ALTERNATING else " ").join(words))


def man_sections(source: str) -> dict[str, str] | None:
    """Section name → plain text of one page's roff source; None for an alias (``.so``) page."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for raw in source.splitlines():
        if raw.startswith(".so "):
            return None
        if raw.startswith(('.\\"', "'\\\"", '.\\"')) or raw.strip() in {".", ""}:
            continue
        if raw.startswith((".", "'")):
            name, _, arguments = raw[1:].strip().partition(" ")
            if name in {"SH", "SS"}:
                title = _macro_text(name, arguments).strip().upper()
                if name == "SH":
                    current = sections.setdefault(title, [])
                elif current is not None:
                    current.append(title.title() + ".")
            elif name in _TEXT_MACROS and current is not None and arguments:
                current.append(_macro_text(name, arguments))
            continue
        if current is not None:
            current.append(roff_to_text(raw))
    return {title: " ".join(" ".join(lines).split()) for title, lines in sections.items()}


def _man_files(packages: tuple[str, ...]) -> list[Path]:
    try:
        listing = subprocess.run(
            ["dpkg", "-L", *packages], check=True, capture_output=True, text=True
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError) as error:
        raise SystemExit(
            f"cannot list the files of {', '.join(packages)} ({error}); "
            f"install them: apt-get install -y {' '.join(packages)}"
        ) from error
    pages = (Path(p) for p in listing if re.fullmatch(r"/usr/share/man/man\d/[^/]+\.\d\w*\.gz", p))
    return sorted(page for page in pages if not page.is_symlink())  # a link is another name of a page


def manpages_set(packages: tuple[str, ...] = MAN_PACKAGES) -> EvaluationSet:
    """Each page (no link, no ``.so`` alias) with a NAME description: a query and its passages."""
    documents: list[tuple[str, str, str, str]] = []
    for path in _man_files(packages):
        sections = man_sections(gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace"))
        if not sections or "NAME" not in sections:
            continue
        _, dash, description = sections.pop("NAME").partition(" - ")
        body = "\n\n".join(f"{title.title()}. {text}" for title, text in sections.items() if text)
        if not dash or len(description.split()) < MIN_QUERY_WORDS or len(body.split()) < MIN_DOCUMENT_WORDS:
            continue
        page, section = path.name.removesuffix(".gz").rsplit(".", 1)
        documents.append((f"man{section}/{page}", f"{page}({section})", body, description.strip()))
    return _evaluation_set(documents, split=True)


def _summary_and_body(docstring: str) -> tuple[str, str]:
    summary, _, body = docstring.strip().partition("\n\n")
    return " ".join(summary.split()), body.strip()


def pydoc_set() -> EvaluationSet:
    """Every stdlib function or class docstring with a summary line and a body of its own."""
    documents = []
    for _, entries in stdlib_docstrings():
        for qualified, docstring in entries:
            summary, body = _summary_and_body(docstring)
            words = len(summary.split())
            if MIN_QUERY_WORDS <= words <= 30 and len(body.split()) >= MIN_DOCUMENT_WORDS:
                documents.append((qualified, qualified, body, summary))
    return _evaluation_set(documents, split=False)


def scale_set(documents: int, seed: int = 0) -> EvaluationSet:
    """``pydoc`` plus manual-page windows as distractors, ``documents`` passages in all."""
    base = pydoc_set()
    words = " ".join(p.text for p in manpages_set().passages).split()
    rng = np.random.default_rng(seed)
    lengths = rng.integers(30, 91, size=max(0, documents - len(base.passages)))
    starts = rng.integers(0, len(words) - 90, size=len(lengths))
    distractors = [
        Passage(f"window/{n}", f"manual excerpt {n}", " ".join(words[start : start + length]))
        for n, (start, length) in enumerate(zip(starts, lengths, strict=True))
    ]
    return EvaluationSet(base.passages + distractors, base.queries)


def _evaluation_set(documents: list[tuple[str, str, str, str]], split: bool) -> EvaluationSet:
    """Passages and queries from (id, title, text, query); a query shared by two documents is dropped.

    A repeated id (a function defined twice under one name) keeps its first definition.
    """
    counts = Counter(query.lower() for *_, query in documents)
    passages: list[Passage] = []
    queries: list[dict[str, str]] = []
    seen: set[str] = set()
    for doc_id, title, text, query in documents:
        if doc_id in seen:
            continue
        seen.add(doc_id)
        if split:
            passages.extend(
                Passage(f"{doc_id}#{n}", title, chunk) for n, chunk in enumerate(split_text(text))
            )
        else:
            passages.append(Passage(doc_id, title, text))
        if counts[query.lower()] == 1:
            queries.append({"query": query, "answer_id": doc_id})
    return EvaluationSet(passages, queries)


def write_set(evaluation: EvaluationSet, directory: Path) -> tuple[Path, Path]:
    corpus, queries = directory / "corpus.jsonl", directory / "queries.jsonl"
    atomic_write_text(corpus, "".join(p.to_json() + "\n" for p in evaluation.passages))
    atomic_write_text(queries, "".join(json.dumps(q, ensure_ascii=False) + "\n" for q in evaluation.queries))
    return corpus, queries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("name", choices=("manpages", "pydoc", "scale"))
    parser.add_argument("--documents", type=int, default=60_000, help="size of the scale set")
    parser.add_argument("--out", required=True, help="directory for corpus.jsonl and queries.jsonl")
    args = parser.parse_args()
    builders = {"manpages": manpages_set, "pydoc": pydoc_set, "scale": lambda: scale_set(args.documents)}
    evaluation = builders[args.name]()
    corpus, queries = write_set(evaluation, Path(args.out))
    print(f"wrote {len(evaluation.passages)} passages to {corpus} and its queries to {queries}")


if __name__ == "__main__":
    main()
