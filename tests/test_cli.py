"""The console command: sub-commands are wired, mistakes give a message and exit status 2."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from specrag.cli import build_parser, main
from specrag.paths import DataLayout
from specrag.pipeline.document_kv.store import SUFFIX as KV_SUFFIX
from specrag.retrieval.corpus import Passage, write_passages
from specrag.service.cli.commands import _controller_config
from specrag.service.run.assets import Assets
from tests.helpers.builders import QUESTION
from tests.helpers.http import free_port


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
        (["demo", "-k", "0"], "-k must be an integer between 1 and"),
        (["demo", "--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["corpus", "build", "--words", "3"], "target_words must be at least"),
        (["serve", "--document-kv-fresh", "-1"], "--document-kv-fresh must be an integer between 0 and 50"),
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


@pytest.mark.parametrize(
    ("argv", "hint"), [([], False), (["--order-hint"], True), (["--no-order-hint"], False)]
)
def test_serve_switches_the_order_hint(argv: list[str], hint: bool) -> None:
    assert _controller_config(build_parser().parse_args(["serve", *argv])).order_hint is hint


@pytest.mark.parametrize(("argv", "setting"), [([], "auto"), (["--speculation", "never"], "never")])
def test_serve_speculation_sets_the_controller_s(argv: list[str], setting: str) -> None:
    assert _controller_config(build_parser().parse_args(["serve", *argv])).speculation == setting


def test_an_unknown_speculation_setting_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--speculation", "sometimes"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err


def test_an_option_before_the_subcommand_is_not_reset_by_the_subcommand_default() -> None:
    args = build_parser().parse_args(["--data-dir", "/somewhere", "-v", "serve"])
    assert args.data_dir == "/somewhere" and args.verbose is True


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (
            ["serve", "--help"],
            [
                "(default: 8080)",
                "(default: all)",
                "(default: by index kind, 6 for IVF, 5 for HNSW)",
                "(default: geometric)",
                "(default: auto; see docs/speculation.md)",
            ],
        ),
        (["index", "build", "--help"], ["(default: ivf)", "(default: 1024)", "--data-dir"]),
        (["demo", "--help"], ["(default: 5)", "(default: 48)", "--verbose"]),
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


def test_verbose_shows_specrag_s_own_steps(tiny_assets: Assets) -> None:
    data_dir = tiny_assets.store.path.parent.parent
    model = str(tiny_assets.model_dir)
    result = run_cli("--data-dir", str(data_dir), "prepare", "--model", model, "-v", cwd=data_dir)
    assert result.returncode == 0, result.stderr
    assert "loaded the vector index" in result.stderr and "up to date" in result.stderr
    quiet = run_cli("--data-dir", str(data_dir), "prepare", "--model", model, cwd=data_dir)
    assert "loaded the vector index" not in quiet.stderr


@pytest.mark.engine
def test_sigint_with_a_query_in_flight_stops_quietly_and_cleans_up(
    tiny_assets: Assets, tmp_path: Path
) -> None:
    data_dir = tiny_assets.store.path.parent.parent  # the data directory tiny_assets was built in
    port = free_port()
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "-m", "specrag", "--data-dir", str(data_dir), "serve"]
    command += ["--model", str(tiny_assets.model_dir), "--eager", "--port", str(port)]
    # serve's 8,192-token limit is beyond the tiny model's 4,096 positions; its prompts are short.
    env = {**os.environ, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    with log_path.open("w") as log:
        # Its own process group, so that killing the group in `finally` reaches vLLM's processes too.
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while "specrag serving on" not in log_path.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        run_dir = data_dir / "run" / f"serve-{process.pid}"
        assert run_dir.is_dir()
        body = json.dumps({"query": QUESTION, "k": 4, "max_tokens": 1024, "stream": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/rag", data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=60) as response:
            response.readline()  # the answer is streaming: a query is in flight
            process.send_signal(signal.SIGINT)
            # It finishes, or its connection is closed once the shutdown grace is over.
            with contextlib.suppress(OSError, http.client.HTTPException):
                response.read()
        assert process.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    output = log_path.read_text()
    for noise in ("Traceback", "replacing the engine", "leaked shared_memory"):
        assert noise not in output, output[-3000:]
    assert not run_dir.exists()


@pytest.mark.engine
def test_prepare_document_kv_stores_the_system_prompt_and_every_passage_once(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    write_passages(corpus, [Passage(f"p{i}", f"Note {i}", f"The answer is {i * 7}.") for i in range(3)])
    data_dir = tmp_path / "data"
    kv_dir = DataLayout(data_dir).document_kv_dir
    argv = ["--data-dir", str(data_dir), "prepare", "--model", str(tiny_model_dir), "--corpus", str(corpus)]
    first = run_cli(*argv, "--document-kv", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "document KV ready: 4 segments computed" in first.stdout  # the system prompt and 3 passages
    stored = sorted(kv_dir.rglob(f"*{KV_SUFFIX}"))
    assert len(stored) == 4 and all(path.stat().st_size > 0 for path in stored)
    again = run_cli(*argv, "--document-kv", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "document KV ready: 0 segments computed" in again.stdout
    assert sorted(kv_dir.rglob(f"*{KV_SUFFIX}")) == stored
