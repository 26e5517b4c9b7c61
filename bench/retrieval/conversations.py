"""Follow-up questions: how often the answering passage is in the top k, alone and with the conversation.

``python -m bench.retrieval.conversations [--data-dir DIR]`` searches the service's default index
(the embedded corpus, WordLlama + BM25; built in the data directory if missing) with a multi-turn
question set made from the corpus, and scores recall@k of the one passage that answers each turn:

- a conversation is about one class or module of the standard library: turn 1 names it ("What
  is the class `FTP` of the module `ftplib` for?", answered by the passage holding ``ftplib.FTP``'s
  docstring); turn 2 refers to it by a pronoun and asks for one of its methods (or functions) by
  the first sentence of its docstring ("And which of its methods sends an EPRT command with the
  current host and the given port number?"), answered by the passage holding
  ``ftplib.FTP.sendeprt``'s docstring; the follow-ups whose passage is not turn 1's are also
  scored apart;
- a *change of subject* is a turn 2 that asks another conversation's self-contained turn 1:
  joining the previous question must not lose what that question finds by itself.

Each turn 2 is searched alone (as the service did before it searched with the conversation) and
joined with the previous question by :func:`specrag.retrieval.conversational.conversation_query`,
the service's own code, at several weights of the previous question (0 is alone; the service's
is :data:`~specrag.retrieval.conversational.PREVIOUS_QUESTION_WEIGHT`). Recall is given with 95 %
bootstrap intervals over conversations, and the follow-ups' recall minus the first turns' as a
paired difference with its interval. Results go to ``bench/out/conversations.json`` and ``.png``;
the last line printed is the JSON summary docs/retrieval.md quotes.
"""

from __future__ import annotations

import argparse
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import pyplot as plt

from bench.common import bootstrap_mean_ci, machine, print_summary, save_figure, write_report
from bench.indexes import distinct_passages, one_search_thread
from specrag.paths import DataLayout, resolve_data_dir
from specrag.retrieval.conversational import PREVIOUS_QUESTION_WEIGHT, conversation_query
from specrag.retrieval.corpus import Passage
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assets import ensure_corpus, ensure_index

KS = (1, 5, 10)
WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_CONVERSATIONS = 1000
# Docstrings start with a verb in the imperative ("Return the ..."), which a question needs in the
# third person ("which method returns the ..."); a docstring that starts with another word is left out.
_VERBS = frozenset(
    [
        "accept",
        "acquire",
        "add",
        "append",
        "apply",
        "build",
        "call",
        "cancel",
        "change",
        "check",
        "clear",
        "close",
        "compare",
        "compute",
        "connect",
        "convert",
        "copy",
        "create",
        "decode",
        "delete",
        "dispatch",
        "emit",
        "encode",
        "execute",
        "extend",
        "fetch",
        "find",
        "flush",
        "format",
        "generate",
        "get",
        "handle",
        "initialize",
        "insert",
        "issue",
        "iterate",
        "join",
        "load",
        "log",
        "look",
        "make",
        "match",
        "notify",
        "open",
        "parse",
        "pop",
        "print",
        "process",
        "push",
        "put",
        "raise",
        "read",
        "receive",
        "register",
        "release",
        "remove",
        "reset",
        "resolve",
        "retrieve",
        "return",
        "run",
        "save",
        "search",
        "select",
        "send",
        "set",
        "show",
        "shut",
        "split",
        "start",
        "stop",
        "store",
        "tell",
        "test",
        "translate",
        "turn",
        "update",
        "validate",
        "wait",
        "write",
        "yield",
    ]
)
_LITTLE_WORDS = frozenset(
    [
        "a",
        "an",
        "the",
        "of",
        "to",
        "for",
        "with",
        "and",
        "or",
        "in",
        "on",
        "from",
        "by",
        "if",
        "that",
        "which",
        "is",
        "are",
        "as",
        "at",
        "be",
        "when",
        "there",
        "it",
        "its",
        "whether",
    ]
)
# A follow-up asks as tersely as people do: the docstring's verb and the next few words.
FOLLOW_UP_WORDS = 4
_ENTRY = re.compile(
    r"(?:^|(?<=\s))(?P<name>(?:[A-Za-z_][A-Za-z0-9_]*\.)+[A-Za-z][A-Za-z0-9_]*): "
    r"(?P<sentence>[A-Z][^.!?:]{15,200}[.!?])(?=\s|$)"
)


@dataclass(frozen=True)
class Turn:
    question: str
    passage_id: str


@dataclass(frozen=True)
class Conversation:
    first: Turn
    follow_up: Turn


def _third_person(sentence: str, words: int) -> str | None:
    """``Return the value of the key.`` as ``returns the value`` (its first ``words`` words, no
    trailing little word); None unless it starts with a known verb."""
    verb, *kept = sentence.rstrip(".!?").split()[:words]
    while kept and kept[-1].lower() in _LITTLE_WORDS:
        kept.pop()
    base, rest = verb.lower(), " ".join(kept)
    if base not in _VERBS or not rest:
        return None
    if base.endswith(("s", "sh", "ch", "x", "z", "o")):
        verb = base + "es"
    elif base.endswith("y") and base[-2] not in "aeiou":
        verb = base[:-1] + "ies"
    else:
        verb = base + "s"
    return f"{verb} {rest}"


def build_conversations(
    passages: Sequence[Passage], count: int, seed: int = 0, words: int = FOLLOW_UP_WORDS
) -> list[Conversation]:
    """Up to ``count`` conversations drawn with ``seed``, in a stable order: a class and one of its
    methods, or a module and one of its functions, asked for by ``words`` words of its docstring."""
    subjects: dict[str, tuple[str, str]] = {}  # module or module.Class -> (its question, passage id)
    members: list[tuple[str, str, str]] = []  # (subject, "methods" or "functions" + the ask, passage id)
    for passage in passages:
        if not passage.id.startswith("doc/") or ": " not in passage.title:
            continue
        module = passage.title.split(": ", 1)[1]
        if passage.id == f"doc/{module}#0":  # the module's docstring opens its first passage
            subjects[module] = (f"What is the module `{module}` for?", passage.id)
        for match in _ENTRY.finditer(passage.text):
            name = match["name"]
            parts = name[len(module) + 1 :].split(".") if name.startswith(module + ".") else []
            if len(parts) == 1 and parts[0][0].isupper():
                question = f"What is the class `{parts[0]}` of the module `{module}` for?"
                subjects.setdefault(name, (question, passage.id))
                continue
            asked = _third_person(match["sentence"], words)
            if asked is None or not parts or parts[-1].startswith("_"):
                continue
            if len(parts) == 2 and parts[0][0].isupper():
                members.append((f"{module}.{parts[0]}", f"methods {asked}", passage.id))
            elif len(parts) == 1:
                members.append((module, f"functions {asked}", passage.id))
    conversations = sorted(
        {
            Conversation(Turn(*subjects[subject]), Turn(f"And which of its {asked}?", passage_id))
            for subject, asked, passage_id in members
            if subject in subjects
        },
        key=lambda c: (c.first.question, c.follow_up.question),
    )
    rng = random.Random(seed)
    return sorted(rng.sample(conversations, min(count, len(conversations))), key=lambda c: c.first.question)


def found_at(index: VectorIndex, question: str, previous: Sequence[str], answer: str, weight: float) -> int:
    """The 1-based rank of passage ``answer`` in the hybrid top max(KS), 0 when it is not there."""
    query = conversation_query(index, question, previous, weight=weight)
    _, ids = index.search(query.vector, max(KS), query_text=query.text)
    ranked = distinct_passages(index, ids)
    return ranked.index(answer) + 1 if answer in ranked else 0


def recall(ranks: np.ndarray, rng: np.random.Generator) -> dict[str, Any]:
    """recall@k with its 95 % bootstrap interval, per k."""
    result: dict[str, Any] = {}
    for k in KS:
        hits = ((ranks > 0) & (ranks <= k)).astype(float)
        result[f"recall_at_{k}"] = round(float(hits.mean()), 3)
        result[f"recall_at_{k}_ci"] = [round(x, 3) for x in bootstrap_mean_ci(hits, rng)]
    return result


def paired(first: np.ndarray, then: np.ndarray, rng: np.random.Generator) -> dict[str, Any]:
    """recall@k of ``then`` minus ``first``, question by question, with its interval."""
    result: dict[str, Any] = {}
    for k in KS:
        difference = ((then > 0) & (then <= k)).astype(float) - ((first > 0) & (first <= k)).astype(float)
        result[f"at_{k}"] = round(float(difference.mean()), 3)
        result[f"at_{k}_ci"] = [round(x, 3) for x in bootstrap_mean_ci(difference, rng)]
    return result


def run(index: VectorIndex, conversations: list[Conversation], seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    others = conversations[1:] + conversations[:1]  # a change of subject: the next one's first turn
    with one_search_thread():
        first = np.array(
            [found_at(index, c.first.question, (), c.first.passage_id, 0.0) for c in conversations]
        )
        follow_ups: dict[float, np.ndarray] = {}
        changes: dict[float, np.ndarray] = {}
        for weight in WEIGHTS:
            follow_ups[weight] = np.array(
                [
                    found_at(index, c.follow_up.question, [c.first.question], c.follow_up.passage_id, weight)
                    for c in conversations
                ]
            )
            changes[weight] = np.array(
                [
                    found_at(index, o.first.question, [c.first.question], o.first.passage_id, weight)
                    for c, o in zip(conversations, others, strict=True)
                ]
            )
            print(
                f"weight {weight}: follow-ups recall@10 {np.mean(follow_ups[weight] > 0):.3f}, "
                f"changes of subject {np.mean(changes[weight] > 0):.3f}",
                flush=True,
            )
    chosen = PREVIOUS_QUESTION_WEIGHT
    other = np.array([c.first.passage_id != c.follow_up.passage_id for c in conversations])
    return {
        "conversations": len(conversations),
        "chosen_weight": chosen,
        "first_turns": recall(first, rng),
        "follow_ups_alone": recall(follow_ups[0.0], rng),
        "follow_ups_with_conversation": recall(follow_ups[chosen], rng),
        "changes_of_subject_alone": recall(changes[0.0], rng),
        "changes_of_subject_with_conversation": recall(changes[chosen], rng),
        "follow_ups_minus_first_turns": {
            "alone": paired(first, follow_ups[0.0], rng),
            "with_conversation": paired(first, follow_ups[chosen], rng),
        },
        "change_of_subject_cost": paired(changes[0.0], changes[chosen], rng),
        # The follow-ups whose answer is another passage than the first turn's: joining the first
        # question cannot help there by finding the first turn's passage again.
        "other_passage": {
            "conversations": int(other.sum()),
            "first_turns": recall(first[other], rng),
            "follow_ups_alone": recall(follow_ups[0.0][other], rng),
            "follow_ups_with_conversation": recall(follow_ups[chosen][other], rng),
        },
        "weights": [
            {
                "weight": weight,
                "follow_ups": recall(follow_ups[weight], rng),
                "changes_of_subject": recall(changes[weight], rng),
            }
            for weight in WEIGHTS
        ],
        "examples": [
            {"turn_1": c.first.question, "turn_2": c.follow_up.question, "answer": c.follow_up.passage_id}
            for c in conversations[:3]
        ],
    }


def draw(result: dict[str, Any], path: Path) -> None:
    figure, (bars, sweep) = plt.subplots(1, 2, figsize=(13, 4.5))
    rows = [
        ("first turns", result["first_turns"]),
        ("follow-ups alone", result["follow_ups_alone"]),
        ("follow-ups with the conversation", result["follow_ups_with_conversation"]),
        ("changes of subject alone", result["changes_of_subject_alone"]),
        ("changes of subject with the conversation", result["changes_of_subject_with_conversation"]),
    ]
    positions = np.arange(len(rows))
    for offset, k in zip((-0.25, 0.0, 0.25), KS, strict=True):
        values = np.array([row[f"recall_at_{k}"] for _, row in rows])
        intervals = np.array([row[f"recall_at_{k}_ci"] for _, row in rows])
        errors = np.abs(intervals.T - values)
        bars.barh(positions + offset, values, height=0.25, xerr=errors, label=f"recall@{k}")
    bars.set_yticks(positions, [name for name, _ in rows])
    bars.invert_yaxis()
    bars.set_xlim(0, 1)
    bars.set_xlabel("answering passage among the first k (95 % interval)")
    bars.set_title(f"{result['conversations']} two-turn conversations, weight {result['chosen_weight']}")
    bars.legend(loc="lower right")
    weights = [row["weight"] for row in result["weights"]]
    for key, label in (("follow_ups", "follow-ups"), ("changes_of_subject", "changes of subject")):
        sweep.plot(weights, [row[key]["recall_at_10"] for row in result["weights"]], marker="o", label=label)
    sweep.axhline(result["first_turns"]["recall_at_10"], color="grey", linestyle=":", label="first turns")
    sweep.set_xlabel("weight of the previous question (0: the question alone)")
    sweep.set_ylabel("recall@10")
    sweep.set_ylim(0, 1)
    sweep.legend()
    save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.retrieval.conversations", description=__doc__.splitlines()[0] if __doc__ else ""
    )
    parser.add_argument(
        "--data-dir", help="the service's data directory (default: $SPECRAG_DATA_DIR or ./data)"
    )
    parser.add_argument("--conversations", type=int, default=DEFAULT_CONVERSATIONS, help="how many to draw")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--words",
        type=int,
        default=FOLLOW_UP_WORDS,
        help="words of the docstring's first sentence a follow-up asks with (default: %(default)s)",
    )
    parser.add_argument("--name", default="conversations", help="basename of the JSON and PNG in bench/out/")
    args = parser.parse_args()
    if args.conversations < 2:
        parser.error("--conversations must be at least 2")
    layout = DataLayout(resolve_data_dir(args.data_dir))
    passages = ensure_corpus(layout)
    index = ensure_index(layout, passages)
    conversations = build_conversations(passages, args.conversations, args.seed, args.words)
    if len(conversations) < 2:
        raise SystemExit("the corpus holds fewer than two conversations: use the embedded corpus")
    result = run(index, conversations, args.seed)
    result.update(machine=machine(), passages=len(passages))
    json_path, png_path = write_report(args.name, result, lambda path: draw(result, path))
    print(f"wrote {json_path} and {png_path}", flush=True)
    summary = {
        key: {k: result[key][k] for k in ("recall_at_5", "recall_at_5_ci", "recall_at_10", "recall_at_10_ci")}
        for key in (
            "first_turns",
            "follow_ups_alone",
            "follow_ups_with_conversation",
            "changes_of_subject_alone",
            "changes_of_subject_with_conversation",
        )
    }
    print_summary({"conversations": len(conversations), **summary}, rerun="bench.retrieval.conversations")


if __name__ == "__main__":
    main()
