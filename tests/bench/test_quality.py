"""bench.quality's question set, scoring and summary; one small run of its configurations on real vLLM."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.quality.__main__ import run_conversations, run_single_turn
from bench.quality.questions import QUESTION_COUNT, build_conversations, build_questions, score
from bench.quality.questions import main as questions_main
from bench.quality.summary import agreement, by_gold_position, compare_embedders, headline, summarize
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.corpus import Passage
from specrag.service.run.assets import Assets


def test_questions_are_reproducible_and_answered_by_their_passage(default_corpus: list[Passage]) -> None:
    questions = build_questions(default_corpus, QUESTION_COUNT, seed=0)
    assert QUESTION_COUNT >= 300  # fewer leave paired intervals too wide to decide (docs/turbo.md)
    assert len(questions) == QUESTION_COUNT == len({q.qualified_name for q in questions})
    assert questions == build_questions(default_corpus, QUESTION_COUNT, seed=0)
    assert questions != build_questions(default_corpus, QUESTION_COUNT, seed=1)
    texts = {p.id: p.text for p in default_corpus}
    for question in questions:
        assert f"{question.qualified_name}: " in texts[question.passage_id]  # the passage holds the answer
        local = question.qualified_name.removeprefix(question.answer + ".")
        assert f"`{local}`" in question.question  # the question names the function or class ...
        assert f"{question.answer}." not in question.question  # ... but not its module


def test_the_set_prints_as_retrieval_queries(
    default_corpus: list[Passage], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("specrag.retrieval.corpus.build_default_corpus", lambda: default_corpus)
    monkeypatch.setattr("sys.argv", ["bench.quality.questions", "--count", "3", "--as-retrieval-queries"])
    questions_main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        {"query": q.question, "answer_id": q.passage_id} for q in build_questions(default_corpus, 3)
    ]


def test_conversations_pair_two_names_of_one_module(default_corpus: list[Passage]) -> None:
    questions = build_questions(default_corpus, 50)
    conversations = build_conversations(default_corpus, 20, exclude=questions)
    assert len(conversations) == 20
    taken = {q.qualified_name for q in questions}
    for conversation in conversations:
        first, second = conversation.turns
        assert (
            first.qualified_name.split(".")[0] == second.qualified_name.split(".")[0] == conversation.module
        )
        assert first != second and not {first.qualified_name, second.qualified_name} & taken


@pytest.mark.parametrize(
    ("answer", "gold", "expected"),
    [
        ("itemgetter", "itemgetter", {"accuracy": 1.0, "exact_match": 1.0, "f1": 1.0}),
        ("`operator.itemgetter`.", "itemgetter", {"accuracy": 1.0, "exact_match": 0.0, "f1": 2 / 3}),
        ("The function is itemgetter", "itemgetter", {"accuracy": 1.0, "exact_match": 0.0, "f1": 2 / 5}),
        ("attrgetter", "itemgetter", {"accuracy": 0.0, "exact_match": 0.0, "f1": 0.0}),
        ("ROTATION_FILENAME", "rotation_filename", {"accuracy": 1.0, "exact_match": 1.0, "f1": 1.0}),
        ("", "S_IFMT", {"accuracy": 0.0, "exact_match": 0.0, "f1": 0.0}),
    ],
)
def test_scores(answer: str, gold: str, expected: dict[str, float]) -> None:
    assert score(answer, gold) == pytest.approx(expected)


def _row(
    accuracy: float, tokens: list[int], adopted: bool = False, prompt_rows: tuple[int, ...] = (7, 8)
) -> dict[str, object]:
    return {
        "gold_row": 7,
        "prompt_rows": list(prompt_rows),
        "accuracy": accuracy,
        "exact_match": accuracy,
        "f1": accuracy,
        "tokens": tokens,
        "adopted": adopted,
        "gold_retrieved": True,
        "reordered": False,
    }


def test_summary_pairs_each_configuration_with_its_baseline() -> None:
    results = {
        "no_documents": [_row(0, [1]), _row(0, [2]), _row(0, [3]), _row(1, [4])],
        "serial": [_row(1, [1]), _row(1, [2]), _row(0, [3]), _row(1, [4])],
        "speculation": [_row(1, [1], True), _row(1, [9], True), _row(0, [3]), _row(1, [4])],
        "multiturn_dedup": [_row(1, []), _row(0, [])],
        "multiturn_full": [_row(1, []), _row(1, [])],
    }
    summary = summarize(results, seed=0)
    assert summary["serial"]["accuracy"] == 0.75 and "delta_vs_serial_ci" not in summary["serial"]
    assert summary["no_documents"]["accuracy_delta_vs_serial"] == -0.5
    assert summary["speculation"]["adopted"] == 0.5
    assert summary["speculation"]["identical_to_serial"] == 0.5  # one of the two adopted answers differs
    assert summary["multiturn_dedup"]["accuracy_delta_vs_full_history"] == -0.5
    low, high = summary["no_documents"]["delta_vs_serial_ci"]
    assert low <= -0.5 <= high
    assert summary["serial"]["by_gold_position"] == {"1": {"questions": 4, "accuracy": 0.75}}
    line = headline({"model": "m", "questions": 4, "conversations": 2}, summary)
    assert (
        set(line["configs"]) == set(results) and line["configs"]["speculation"]["identical_to_serial"] == 0.5
    )


def test_accuracy_is_split_by_where_the_answering_passage_sits_in_the_prompt() -> None:
    rows = [
        _row(1, [1], prompt_rows=(7, 8)),
        _row(0, [2], prompt_rows=(8, 7)),
        _row(1, [3], prompt_rows=(8, 7)),
    ]
    rows.append(_row(0, [4], prompt_rows=(5, 6)))
    assert by_gold_position(rows) == {
        "0": {"questions": 1, "accuracy": 0.0},
        "1": {"questions": 1, "accuracy": 1.0},
        "2": {"questions": 2, "accuracy": 0.5},
    }


def _answered(accuracy: list[int], gold: list[bool]) -> list[dict[str, object]]:
    return [
        {**_row(a, [i]), "gold_retrieved": g} for i, (a, g) in enumerate(zip(accuracy, gold, strict=True))
    ]


def test_embedders_are_compared_question_by_question() -> None:
    minilm = _answered([1, 1, 1, 0, 0, 1], [True, True, True, False, False, True])
    wordllama = _answered([1, 0, 0, 0, 0, 1], [True, False, True, False, False, True])
    results = {
        "serial": minilm,
        "ordering_no_hint": minilm,
        "serial@wordllama": wordllama,
        "ordering_no_hint@wordllama": minilm,
    }
    comparison = compare_embedders(results, "minilm", ["wordllama"], seed=0)
    serial = comparison["serial"]
    assert serial["minilm"]["accuracy"]["mean"] == pytest.approx(4 / 6)
    assert serial["wordllama"]["accuracy"]["mean"] == pytest.approx(2 / 6)
    assert serial["minilm"]["gold_retrieved"]["mean"] == pytest.approx(4 / 6)
    assert serial["wordllama"]["gold_retrieved"]["mean"] == pytest.approx(3 / 6)
    difference = serial["minilm_minus_wordllama"]
    assert difference["accuracy"]["mean"] == pytest.approx(2 / 6)
    assert difference["gold_retrieved"]["mean"] == pytest.approx(1 / 6)
    low, high = difference["accuracy"]["ci"]
    assert 0 <= low <= 2 / 6 <= high <= 1  # paired: no question's difference is negative
    # The same answers on both indexes differ by nothing, with no spread at all.
    same = comparison["ordering_no_hint"]["minilm_minus_wordllama"]["accuracy"]
    assert same == {"mean": 0.0, "ci": [0.0, 0.0]}


def test_agreement_counts_answers_equal_to_those_computed_alone() -> None:
    together = [_row(1, [1, 2]), _row(0, [3]), _row(1, [4])]
    alone = [_row(1, [1, 2]), _row(0, [5]), _row(0, [4, 6])]
    assert agreement(together, alone) == {"questions": 3, "identical_tokens": 1, "same_accuracy": 2}


@pytest.mark.engine
async def test_every_configuration_answers_on_the_real_engine(
    vllm_engine: VllmEngine, tiny_assets: Assets, default_corpus: list[Passage]
) -> None:
    """A small run: every configuration answers every question; speculation's adopted answers are
    serial's token for token (greedy, same final prompt)."""
    builder = PromptBuilder(tiny_assets.tokenizer, tiny_assets.store, block_size=vllm_engine.block_size)
    args = argparse.Namespace(k=3, max_tokens=4, concurrency=2)
    questions = build_questions(tiny_assets.passages, 4, seed=2)
    compared = {"again": tiny_assets.index}  # the same index again: the same retrieval, in order
    results = await run_single_turn(vllm_engine, None, tiny_assets, builder, questions, args, compared)
    conversations = build_conversations(tiny_assets.passages, 2, exclude=questions)
    results |= await run_conversations(vllm_engine, None, tiny_assets, builder, conversations, args)
    summary = summarize(results, seed=0)
    assert {len(rows) for name, rows in results.items() if not name.startswith("multiturn")} == {4}
    assert len(results["multiturn_dedup"]) == len(results["multiturn_full"]) == 2
    assert summary["speculation"]["identical_to_serial"] in (None, 1.0)
    # Asked concurrently, every record still belongs to its question.
    for name in ("no_documents", "serial", "serial@again", "ordering_no_hint@again"):
        assert [row["question"] for row in results[name]] == [q.question for q in questions]
    assert [row["documents"] for row in results["serial@again"]] == [
        row["documents"] for row in results["serial"]
    ]
    # Retrieval finds the passage naming the function or class (the full run reports how often).
    assert sum(row["gold_retrieved"] for row in results["serial"]) >= 1
    # The de-duplicated turn sends fewer tokens than the full history whenever documents repeat.
    for dedup, full in zip(results["multiturn_dedup"], results["multiturn_full"], strict=True):
        assert dedup["prompt_tokens"] <= full["prompt_tokens"]
