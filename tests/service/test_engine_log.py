"""serve's and demo's terminal: specrag's own lines there, what the engine, its
processes and the libraries print in the log file; ``--help`` in plain text."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from specrag.cli import _sub_parsers, build_parser
from specrag.service.cli.engine_log import engine_output_to
from specrag.service.run.assets import Assets
from tests.helpers.builders import QUESTION


def test_a_child_process_and_the_libraries_write_to_the_log_and_specrag_to_the_terminal(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    log_file = tmp_path / "run" / "serve-1.log"
    # Once vLLM is imported its logger writes to the sys.stdout it found then (in a test session,
    # an earlier test's capture): a library logging through the root logger stands in for it.
    library = "vllm.engine" if not logging.getLogger("vllm").handlers else "a_library.engine"
    with engine_output_to(log_file):
        print("specrag's own line")
        logging.getLogger("specrag.service").warning("specrag's own warning")
        logging.getLogger(library).warning("a vLLM warning")
        logging.getLogger("bm25s").debug("a bm25s DEBUG line")
        warnings.warn("a torch warning", FutureWarning, stacklevel=1)
        child = "import sys; print('child stdout'); print('child stderr', file=sys.stderr)"
        subprocess.run([sys.executable, "-c", child], check=True)  # as vLLM's engine core is started
    print("after the block")
    terminal = capfd.readouterr()
    logged = log_file.read_text()
    assert terminal.out == "specrag's own line\nafter the block\n"
    assert terminal.err.count("\n") == 1 and "specrag's own warning" in terminal.err
    for line in ("a vLLM warning", "a torch warning", "child stdout", "child stderr", "own warning"):
        assert line in logged
    assert "a bm25s DEBUG line" not in terminal.err + terminal.out


def test_every_help_text_is_plain() -> None:
    parser = build_parser()
    for command in [parser, *_sub_parsers(parser)]:
        assert "``" not in command.format_help(), command.prog


@pytest.mark.engine
def test_the_demo_prints_its_own_lines_and_logs_the_engines(tiny_assets: Assets, tmp_path: Path) -> None:
    data_dir = tiny_assets.store.path.parent.parent
    command = [sys.executable, "-m", "specrag", "--data-dir", str(data_dir), "demo"]
    command += ["--model", str(tiny_assets.model_dir), "--eager", "-q", QUESTION, "-k", "4"]
    command += ["--max-tokens", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    said = "engine and library logs: "
    (log_line,) = [line for line in result.stdout.splitlines() if line.startswith(said)]
    log_file = Path(log_line.removeprefix(said).split(" (")[0])
    assert "Q: " in result.stdout and "starting vLLM" in result.stdout
    # vLLM's lines ("(EngineCore pid=…) WARNING …", logger vllm.…), Triton's, torch's, tqdm's, bm25s'.
    noise = re.compile(r"WARNING|pid=|\bvllm\.|Triton|torch|safetensors|bm25s|Warning")
    assert [line for line in (result.stdout + result.stderr).splitlines() if noise.search(line)] == []
    logged = log_file.read_text()
    assert "vllm" in logged.lower() and "WARNING" in logged
