"""The corpus: passages with stable IDs, titles and text.

The default corpus is real English text that exists offline on every machine with Python: the
language reference topics shipped in ``pydoc_data`` and the docstrings of the standard library,
read with ``ast`` from the source files (never imported: some stdlib modules act on import).
Any other corpus loads from JSONL, one ``{"id", "title", "text"}`` object a line.
"""

from __future__ import annotations

import ast
import json
import re
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from specrag.atomic import atomic_write_text
from specrag.errors import ArtifactError, InvalidInputError

__all__ = [
    "DEFAULT_PASSAGE_WORDS",
    "MIN_DOCSTRING_WORDS",
    "MIN_PASSAGE_WORDS",
    "Passage",
    "build_default_corpus",
    "load_passages",
    "split_text",
    "stdlib_docstrings",
    "write_passages",
]

# About 180 words make 250-350 tokens with a small BPE vocabulary: "a few hundred tokens" a passage,
# so a k=10 prompt lands near the 2-4k tokens where prefill time rivals search time.
DEFAULT_PASSAGE_WORDS = 180
MIN_PASSAGE_WORDS = 40
# Docstrings shorter than this are signatures or one-liners that add noise, not content.
MIN_DOCSTRING_WORDS = 12

# Stdlib folders that are tests, tooling or vendored code rather than documentation of the library.
_SKIPPED_STDLIB_PARTS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "lib2to3",
        "site-packages",
        "ensurepip",
        "turtledemo",
        "__pycache__",
    }
)


@dataclass(frozen=True)
class Passage:
    """One retrievable unit. ``id`` is stable across rebuilds of the same source."""

    id: str
    title: str
    text: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


def split_text(text: str, target_words: int = DEFAULT_PASSAGE_WORDS) -> list[str]:
    """Split text into chunks of about ``target_words`` words along paragraph, then sentence, lines.

    Paragraphs are kept whole when they fit; a paragraph longer than the target is cut at sentence
    ends, and a single over-long sentence at word boundaries. A short tail is merged into the
    previous chunk so no passage is a stub.
    """
    if target_words < MIN_PASSAGE_WORDS:
        raise InvalidInputError(f"target_words must be at least {MIN_PASSAGE_WORDS}, got {target_words}")
    pieces: list[list[str]] = []
    for paragraph in re.split(r"\n\s*\n", text):
        words = paragraph.split()
        if not words:
            continue
        if len(words) <= target_words:
            pieces.append(words)
            continue
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(words)):
            sentence_words = sentence.split()
            for start in range(0, len(sentence_words), target_words):
                pieces.append(sentence_words[start : start + target_words])

    chunks: list[list[str]] = []
    current: list[str] = []
    for piece in pieces:
        if current and len(current) + len(piece) > target_words:
            chunks.append(current)
            current = []
        current = current + piece
    if current:
        if chunks and len(current) < MIN_PASSAGE_WORDS:
            chunks[-1] = chunks[-1] + current
        else:
            chunks.append(current)
    return [" ".join(chunk) for chunk in chunks]


def _documents_from_pydoc_topics() -> Iterator[tuple[str, str, str]]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield f"topic/{name}", f"Python language reference: {name}", topics[name]


def _stdlib_source_files(stdlib: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if _SKIPPED_STDLIB_PARTS.intersection(relative.parts) or any(
            p.startswith("_") for p in relative.parts[:-1]
        ):
            continue
        parts = list(relative.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if not parts or parts[-1].startswith("_") or "-" in parts[-1]:
            continue
        yield ".".join(parts), path


def _docstrings(module_name: str, source: str) -> Iterator[tuple[str, str]]:
    """Module, class and public function docstrings of one module, as (qualified name, docstring)."""
    tree = ast.parse(source)
    module_doc = ast.get_docstring(tree)
    if module_doc:
        yield module_name, module_doc

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                if child.name.startswith("_"):
                    continue
                qualified = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child)
                if doc:
                    yield qualified, doc
                if isinstance(child, ast.ClassDef):
                    yield from walk(child, qualified)

    yield from walk(tree, module_name)


def stdlib_docstrings() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """Per documented stdlib module: (module name, [(qualified name, docstring), ...]), sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for module_name, path in _stdlib_source_files(stdlib):
        try:
            yield module_name, list(_docstrings(module_name, path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue


def _documents_from_stdlib_docstrings(min_words: int) -> Iterator[tuple[str, str, str]]:
    """One document per stdlib module: its docstrings, each headed by its qualified name.

    Grouping by module keeps passages near the target length; single docstrings are often short.
    """
    for module_name, entries in stdlib_docstrings():
        text = "\n\n".join(f"{name}: {doc}" for name, doc in entries if len(doc.split()) >= min_words)
        if len(text.split()) >= MIN_PASSAGE_WORDS:
            yield f"doc/{module_name}", f"Python standard library: {module_name}", text


def build_default_corpus(target_words: int = DEFAULT_PASSAGE_WORDS) -> list[Passage]:
    """Passages from pydoc topics and stdlib docstrings, in a deterministic order."""
    documents = [
        *_documents_from_pydoc_topics(),
        *_documents_from_stdlib_docstrings(min_words=MIN_DOCSTRING_WORDS),
    ]
    passages: list[Passage] = []
    for doc_id, title, text in documents:
        for number, chunk in enumerate(split_text(text, target_words)):
            passages.append(Passage(id=f"{doc_id}#{number}", title=title, text=chunk))
    return passages


def write_passages(path: Path, passages: Iterable[Passage]) -> int:
    """Write passages as JSONL atomically; return how many were written."""
    lines = [passage.to_json() for passage in passages]
    seen: set[str] = set()
    for passage_line in lines:
        passage_id = json.loads(passage_line)["id"]
        if passage_id in seen:
            raise InvalidInputError(f"duplicate passage id {passage_id!r}")
        seen.add(passage_id)
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return len(lines)


def load_passages(path: Path) -> list[Passage]:
    """Read a JSONL corpus, naming the file and line of the first malformed record."""
    if path.is_dir():
        raise ArtifactError(f"corpus {path} is a directory: give the JSONL file")
    if not path.is_file():
        raise ArtifactError(f"corpus file not found: {path}")
    passages: list[Passage] = []
    seen: set[str] = set()
    with open(path, "rb") as handle:  # decoded line by line, so an encoding error names its line
        for line_number, raw in enumerate(handle, start=1):
            where = f"{path}:{line_number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ArtifactError(
                    f"{where}: not UTF-8 text ({error.reason} at column {error.start + 1}); "
                    "convert the file, e.g. iconv -f latin1 -t utf-8"
                ) from None
            _add_record(passages, seen, line, where)
    if not passages:
        raise ArtifactError(f"corpus file has no passages: {path}")
    return passages


def _add_record(passages: list[Passage], seen: set[str], line: str, where: str) -> None:
    """Check one JSONL line and append its passage; errors name the file and line."""
    if not line.strip():
        return
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ArtifactError(f"{where}: not valid JSON ({error.msg}: column {error.colno})") from error
    if not isinstance(record, dict):
        raise ArtifactError(f"{where}: expected a JSON object")
    passage_id, text = record.get("id"), record.get("text")
    if not isinstance(passage_id, str | int) or isinstance(passage_id, bool) or str(passage_id) == "":
        raise ArtifactError(f"{where}: 'id' must be a non-empty string or an integer")
    if not isinstance(text, str) or not text.strip():
        raise ArtifactError(f"{where}: 'text' must be a non-empty string")
    title = record.get("title", "")
    if not isinstance(title, str):
        raise ArtifactError(f"{where}: 'title' must be a string")
    key = str(passage_id)
    if key in seen:
        raise ArtifactError(f"{where}: duplicate id {key!r}")
    seen.add(key)
    passages.append(Passage(id=key, title=title, text=text))
