"""bench.quality's question set, scoring and summary; one small run of its configurations on real vLLM."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.quality.__main__ import by_gold_position, headline, run_conversations, run_single_turn, summarize
from bench.quality.questions import QUESTION_COUNT, build_conversations, build_questions, score
from bench.quality.questions import main as questions_main
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


@pytest.mark.engine
async def test_every_configuration_answers_on_the_real_engine(
    vllm_engine: VllmEngine, tiny_assets: Assets, default_corpus: list[Passage]
) -> None:
    """A small run: every configuration answers every question; speculation's adopted answers are
    serial's token for token (greedy, same final prompt)."""
    builder = PromptBuilder(tiny_assets.tokenizer, tiny_assets.store, block_size=vllm_engine.block_size)
    args = argparse.Namespace(k=3, max_tokens=4)
    questions = build_questions(tiny_assets.passages, 4, seed=2)
    results = await run_single_turn(vllm_engine, None, tiny_assets, builder, questions, args)
    conversations = build_conversations(tiny_assets.passages, 2, exclude=questions)
    results |= await run_conversations(vllm_engine, None, tiny_assets, builder, conversations, args)
    summary = summarize(results, seed=0)
    assert {len(rows) for name, rows in results.items() if not name.startswith("multiturn")} == {4}
    assert len(results["multiturn_dedup"]) == len(results["multiturn_full"]) == 2
    assert summary["speculation"]["identical_to_serial"] in (None, 1.0)
    # Retrieval finds the passage naming the function or class (the full run reports how often).
    assert sum(row["gold_retrieved"] for row in results["serial"]) >= 1
    # The de-duplicated turn sends fewer tokens than the full history whenever documents repeat.
    for dedup, full in zip(results["multiturn_dedup"], results["multiturn_full"], strict=True):
        assert dedup["prompt_tokens"] <= full["prompt_tokens"]
