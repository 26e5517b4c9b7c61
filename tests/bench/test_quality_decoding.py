"""The decoding comparison: the loop detector, the model's own recommendation, the choice of a
default, and the identity check on the real engine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bench.quality.decoding import Setting, answerer, check_identity, choose, loops, model_setting
from bench.quality.questions import build_questions
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.service.run.assets import Assets


@pytest.mark.parametrize(
    ("text", "looping"),
    [
        # The demo's answer that motivated the measure: a sentence said again.
        (
            "The asyncio.run function is a function that is used to create and close the event loop. "
            "The asyncio.run function is a function that is used to create",
            True,
        ),
        ("one two three four five six one two three four five six", True),
        ("One two, three four five six. one TWO three four (five) six!", True),  # case and punctuation
        ("no no no no no no no", True),  # one word seven times: the run overlaps itself
        ("no no no no no no", False),  # six times: no run of six seen twice
        ("one two three four five six one two three four five seven", False),  # five words again
        ("The function `FTP.sendeprt` is defined in the `ftplib` module.", False),
        ("", False),
    ],
)
def test_an_answer_loops_when_six_words_come_twice(text: str, looping: bool) -> None:
    assert loops(text) is looping


def test_the_models_recommendation_is_a_setting_only_when_it_recommends_sampling(tmp_path: Path) -> None:
    assert model_setting(tmp_path) is None  # no generation_config.json
    config = tmp_path / "generation_config.json"
    config.write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    assert model_setting(tmp_path) is None
    config.write_text(json.dumps({"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}))
    # No do_sample: transformers decodes greedily, and so does the setting, keeping the penalty.
    assert model_setting(tmp_path) == Setting("generation_config", {"repetition_penalty": 1.1})
    config.write_text(json.dumps({"do_sample": True, "temperature": 0.2, "top_p": 0.9}))
    assert model_setting(tmp_path) == Setting("generation_config", {"temperature": 0.2, "top_p": 0.9})


def _entry(accuracy: float, ci: list[float], loops: float, open_loops: float) -> dict[str, Any]:
    return {
        "accuracy": {"mean": accuracy, "ci": ci},
        "loops": {"mean": loops, "ci": [loops, loops]},
        "open_loops": {"mean": open_loops, "ci": [open_loops, open_loops]},
    }


def test_the_default_keeps_greedys_accuracy_and_loops_least() -> None:
    summary = {
        "greedy": _entry(0.40, [0.35, 0.46], 0.10, 0.60),
        "a": _entry(0.30, [0.25, 0.35], 0.00, 0.00),  # loops least, but loses accuracy
        "b": _entry(0.41, [0.36, 0.47], 0.02, 0.04),
        "c": _entry(0.38, [0.33, 0.44], 0.01, 0.04),  # as few loops as b in the worse set: b is more accurate
        "d": _entry(0.45, [0.40, 0.50], 0.01, 0.20),  # loops on open questions
    }
    assert choose(summary) == {"setting": "b", "worst_loop_share": 0.04, "meets_bar": True}
    summary.pop("b"), summary.pop("c")
    assert choose(summary) == {"setting": "d", "worst_loop_share": 0.20, "meets_bar": False}


def test_a_setting_more_accurate_than_greedys_interval_keeps_its_accuracy() -> None:
    """The 300-question run: the frequency penalty answered above greedy's interval and stopped the
    loops; being better than greedy must not rule it out."""
    summary = {
        "greedy": _entry(0.427, [0.37, 0.48], 0.14, 0.567),
        "frequency_penalty=1.5": _entry(0.490, [0.433, 0.547], 0.01, 0.017),
    }
    assert choose(summary) == {
        "setting": "frequency_penalty=1.5",
        "worst_loop_share": 0.017,
        "meets_bar": True,
    }


@pytest.mark.engine
async def test_the_identity_check_compares_answers_of_the_same_prompt(
    vllm_engine: VllmEngine, tiny_assets: Assets
) -> None:
    """On the real engine, under a penalty: every run answers every question, and an answer whose
    final prompt is serial's (or ordering's) equals it token for token."""
    builder = PromptBuilder(tiny_assets.tokenizer, tiny_assets.store, block_size=vllm_engine.block_size)
    args = argparse.Namespace(k=3, max_tokens=6, concurrency=2)
    answer = answerer(vllm_engine, None, tiny_assets, builder, args)
    questions = build_questions(tiny_assets.passages, 3, seed=2)
    identity = await check_identity(answer, questions, Setting("penalised", {"repetition_penalty": 1.2}))
    for pair in identity.values():
        assert pair["questions"] == 3 and pair["same_prompt"] >= 1
        assert pair["identical_tokens"] == pair["same_prompt"]
