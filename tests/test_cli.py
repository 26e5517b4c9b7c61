"""The console command: sub-commands are wired, mistakes give a message and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specrag.cli import build_parser, main


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specrag", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_corpus_build_writes_jsonl_into_the_data_dir(tmp_path: Path) -> None:
    result = run_cli("--data-dir", str(tmp_path / "d"), "corpus", "build", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    corpus = tmp_path / "d" / "corpus" / "passages.jsonl"
    first = json.loads(corpus.read_text().splitlines()[0])
    assert set(first) == {"id", "title", "text"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "-k", "0"], "-k must be between 1 and"),
        (["demo", "--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["corpus", "build", "--words", "3"], "target_words must be at least"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["--data-dir", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_unknown_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_a_missing_user_model_dir_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--data-dir", str(tmp_path), "prepare", "--model", str(tmp_path / "nope")]) == 2
    assert "model directory not found" in capsys.readouterr().err


@pytest.mark.parametrize("position", ["before", "after"])
def test_global_options_work_before_and_after_the_subcommand(tmp_path: Path, position: str) -> None:
    data_dir = tmp_path / f"d-{position}"
    options = ["--data-dir", str(data_dir), "-v"]
    argv = [*options, "corpus", "build"] if position == "before" else ["corpus", "build", *options]
    assert main(argv) == 0
    assert (data_dir / "corpus" / "passages.jsonl").is_file()


def test_an_option_before_the_subcommand_is_not_reset_by_the_subcommand_default() -> None:
    args = build_parser().parse_args(["--data-dir", "/somewhere", "-v", "serve"])
    assert args.data_dir == "/somewhere" and args.verbose is True


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["serve", "--help"], ["(default: 8080)", "(default: all)", "(default: 4)", "(default: geometric)"]),
        (["index", "build", "--help"], ["(default: ivf)", "(default: 1024)", "--data-dir"]),
        (["demo", "--help"], ["(default: 10)", "(default: 32)", "--verbose"]),
    ],
)
def test_help_shows_defaults_and_the_global_options(
    argv: list[str], shown: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for fragment in shown:
        assert fragment in text
