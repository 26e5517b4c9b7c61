"""The question set of ``bench.quality``: questions whose answers the bundled corpus holds.

The corpus's standard-library passages are docstrings written as ``qualified.name: First
sentence. …``. Each question quotes one such first sentence and asks which function or class it
describes; the answer is the name before it. The sentence is in the passage that names it, so
retrieval can find it and the model can read the answer off the passage; without the passages a
small model would have to know, from one sentence, which of the thousands of standard-library names
it documents (``bench.quality`` measures that too: its ``no_documents`` row). Names that appear in
their own sentence are skipped (they would give the answer away, even inside a word: ``decodes``
for ``decode``), and so are private names.

Conversations (the multi-turn set) pair two questions about names of the same module, so their
passages overlap and de-duplication has documents to drop.

The set is a pure function of the corpus and the seed: ``python -m bench.quality_set`` prints it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import string
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from specrag.retrieval.corpus import Passage

QUESTION_TEMPLATE = (
    'Which function or class of the Python standard library is documented as "{sentence}"? '
    "Answer with its name only."
)
_DOCSTRING = re.compile(
    r"(?:^|(?<=\s))(?P<name>(?:[A-Za-z_][A-Za-z0-9_]*\.)+(?P<short>[A-Za-z][A-Za-z0-9_]*)): "
    r"(?P<sentence>[A-Z][^.!?:]{25,180}[.!?])(?=\s|$)"
)


@dataclass(frozen=True)
class QualityQuestion:
    """One question, its gold answer (the short name) and where the answer is written."""

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
    for passage in passages:
        if not passage.id.startswith("doc/"):
            continue
        for match in _DOCSTRING.finditer(passage.text):
            name, short, sentence = match["name"], match["short"], match["sentence"]
            if short.startswith("_") or len(short) < 4 or short.lower() in sentence.lower():
                continue
            if name in found:
                continue
            found[name] = QualityQuestion(
                QUESTION_TEMPLATE.format(sentence=sentence), short, name, passage.id
            )
    # One question per sentence: two names documented alike would make the answer ambiguous.
    by_question: dict[str, list[QualityQuestion]] = defaultdict(list)
    for question in found.values():
        by_question[question.question].append(question)
    return sorted((qs[0] for qs in by_question.values() if len(qs) == 1), key=lambda q: q.qualified_name)


def build_questions(passages: Sequence[Passage], count: int, seed: int = 0) -> list[QualityQuestion]:
    """``count`` questions drawn with ``seed`` (fewer if the corpus has fewer)."""
    candidates = _candidates(passages)
    return random.Random(seed).sample(candidates, min(count, len(candidates)))


def _module(question: QualityQuestion) -> str:
    return question.qualified_name.rsplit(".", 1)[0].split(".")[0]


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
    cleaned = text.lower().translate(str.maketrans({c: " " for c in string.punctuation if c != "_"}))
    return cleaned.split()


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

    parser = argparse.ArgumentParser(prog="python -m bench.quality_set", description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=104)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    passages = build_default_corpus()
    for question in build_questions(passages, args.count, args.seed):
        print(json.dumps(asdict(question)))


if __name__ == "__main__":
    main()
