"""The question set of ``bench.quality``: questions whose answers the bundled corpus holds.

The corpus's standard-library passages are docstrings written as ``qualified.name: First
sentence. …`` under the title ``Python standard library: module``. Each question names a function
or class by its name inside its module (``FTP.sendeprt``, ``SMTPHandler``) and asks which module
defines it; the answer is the module (``ftplib``, ``logging.handlers``). The passage that documents
the name says so, so retrieval finds it by the name and the model can read the module off it;
without the passages a small model has to know where each of thousands of names lives
(``bench.quality`` measures that too: its ``no_documents`` row). A name defined in more than one
module of the corpus is skipped (the question would be ambiguous), and so are private names.

An earlier form of the set asked the reverse (which name a quoted docstring sentence documents):
SmolLM2-135M-Instruct repeated the sentence instead of naming anything, with or without the passages
(7 of 104 right either way), so it could not tell a configuration that loses accuracy from one
that does not.

Conversations (the multi-turn set) pair two questions about names of the same module, so their
passages overlap and de-duplication has documents to drop.

The set is a pure function of the corpus and the seed: ``python -m bench.quality.questions`` prints it;
with ``--as-retrieval-queries`` it prints it as ``bench.retrieval``'s queries (the question, and
the passage that answers it), to score retrieval alone on it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from specrag.retrieval.corpus import Passage

QUESTION_COUNT = 300
"""The set's default size: enough for a paired interval of about ±0.05 on an accuracy difference
(104 left intervals too wide to tell a configuration that keeps accuracy from one that loses it)."""
QUESTION_TEMPLATE = (
    "In which module of the Python standard library is the {kind} `{name}` defined? "
    "Answer with the module name only."
)
_DOCSTRING = re.compile(
    r"(?:^|(?<=\s))(?P<name>(?:[A-Za-z_][A-Za-z0-9_]*\.)+(?P<short>[A-Za-z][A-Za-z0-9_]*)): "
    r"(?P<sentence>[A-Z][^.!?:]{25,180}[.!?])(?=\s|$)"
)


@dataclass(frozen=True)
class QualityQuestion:
    """One question, its gold answer (the module) and where the answer is written."""

    question: str
    answer: str
    qualified_name: str
    passage_id: str


@dataclass(frozen=True)
class Conversation:
    """Two questions about names of one module, asked in one session."""

    module: str
    turns: tuple[QualityQuestion, QualityQuestion]


def _candidates(passages: Iterable[Passage]) -> list[QualityQuestion]:
    found: dict[str, QualityQuestion] = {}
    local_names: dict[str, set[str]] = defaultdict(set)
    for passage in passages:
        if not passage.id.startswith("doc/") or ": " not in passage.title:
            continue
        module = passage.title.split(": ", 1)[1]
        for match in _DOCSTRING.finditer(passage.text):
            name, short = match["name"], match["short"]
            if not name.startswith(module + ".") or short.startswith("_") or len(short) < 4:
                continue
            local = name[len(module) + 1 :]
            local_names[local].add(module)
            kind = "class" if short[0].isupper() else "function"
            question = QUESTION_TEMPLATE.format(kind=kind, name=local)
            found.setdefault(name, QualityQuestion(question, module, name, passage.id))
    unique = (q for q in found.values() if len(local_names[q.qualified_name[len(q.answer) + 1 :]]) == 1)
    return sorted(unique, key=lambda q: q.qualified_name)


def build_questions(passages: Sequence[Passage], count: int, seed: int = 0) -> list[QualityQuestion]:
    """``count`` questions drawn with ``seed`` (fewer if the corpus has fewer)."""
    candidates = _candidates(passages)
    return random.Random(seed).sample(candidates, min(count, len(candidates)))


def _module(question: QualityQuestion) -> str:
    return question.answer.split(".")[0]


def build_conversations(
    passages: Sequence[Passage], count: int, seed: int = 0, exclude: Iterable[QualityQuestion] = ()
) -> list[Conversation]:
    """``count`` two-turn conversations, each about two names of one top-level module."""
    taken = {q.qualified_name for q in exclude}
    by_module: dict[str, list[QualityQuestion]] = defaultdict(list)
    for question in _candidates(passages):
        if question.qualified_name not in taken:
            by_module[_module(question)].append(question)
    rng = random.Random(seed)
    pairs = []
    for module in sorted(by_module):
        questions = by_module[module]
        rng.shuffle(questions)
        pairs += [Conversation(module, (a, b)) for a, b in zip(questions[::2], questions[1::2], strict=False)]
    return rng.sample(pairs, min(count, len(pairs)))


def words(text: str) -> list[str]:
    """Lower-case words of an answer, dotted names split, punctuation and backticks gone."""
    return re.sub(r"[^\w\s]", " ", text.lower()).split()


def score(answer: str, gold: str) -> dict[str, float]:
    """``accuracy``: the gold name is one of the answer's words (the usual RAG "answer contains the
    gold" metric: a chat model puts the name in a sentence); ``exact_match``: the answer is the
    name and nothing else; ``f1``: word-level F1 of the answer against the gold name (SQuAD's)."""
    predicted, expected = words(answer), words(gold)
    common = sum(min(predicted.count(w), expected.count(w)) for w in set(expected))
    f1 = 0.0
    if common:
        precision, recall = common / len(predicted), common / len(expected)
        f1 = 2 * precision * recall / (precision + recall)
    return {
        "accuracy": float(all(w in predicted for w in expected)),
        "exact_match": float(predicted == expected),
        "f1": f1,
    }


def main() -> None:
    from specrag.retrieval.corpus import build_default_corpus

    parser = argparse.ArgumentParser(
        prog="python -m bench.quality.questions", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--count", type=int, default=QUESTION_COUNT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--as-retrieval-queries",
        action="store_true",
        help='print {"query", "answer_id"} lines for bench.retrieval --queries',
    )
    args = parser.parse_args()
    passages = build_default_corpus()
    for question in build_questions(passages, args.count, args.seed):
        record = (
            {"query": question.question, "answer_id": question.passage_id}
            if args.as_retrieval_queries
            else asdict(question)
        )
        print(json.dumps(record))


if __name__ == "__main__":
    main()
