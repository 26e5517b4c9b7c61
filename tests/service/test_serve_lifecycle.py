"""``specrag serve`` and ``batch`` as a user runs them, on the real engine: the port answers from
the first seconds, the first 200 has an exact KV mirror, SIGINT stops an idle service within
seconds and in order, and ``batch``'s standard output carries nothing but its JSON lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from specrag.service.run.assets import Assets
from tests.helpers.builders import QUESTION
from tests.helpers.http import free_port

pytestmark = pytest.mark.engine

# What vLLM prints when the engine did not stop in order (a process killed, its shared memory left).
DISORDER = ("force killing", "leaked shared_memory", "Traceback")
# serve's 8,192-token limit is beyond the tiny model's 4,096 positions; its prompts are short. The
# commands run this checkout's specrag, whatever directory they run in.
REPOSITORY = Path(__file__).resolve().parents[2]
ENGINE_ENV = {
    **os.environ,
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
    "PYTHONPATH": os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")]),
}


def _get(url: str) -> tuple[int, dict[str, Any], str | None]:
    """Status, JSON body and Retry-After of a GET (an error status is an answer too)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read()), response.headers.get("Retry-After")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers.get("Retry-After")


def _first_answer(url: str, process: subprocess.Popen[str], within_s: float) -> tuple[int, dict[str, Any]]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            status, body, _ = _get(url)
            return status, body
        except OSError:  # not listening yet
            time.sleep(0.1)
    raise AssertionError(f"no answer from {url} within {within_s} s")


def test_serve_answers_503_from_the_start_then_200_and_stops_on_sigint_within_seconds(
    tiny_assets: Assets, tmp_path: Path
) -> None:
    data_dir = tiny_assets.store.path.parent.parent
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "-m", "specrag", "--data-dir", str(data_dir), "serve"]
    command += ["--model", str(tiny_assets.model_dir), "--eager", "--port", str(port)]
    with log_path.open("w") as log:
        # Its own process group, so that killing the group in `finally` reaches vLLM's processes too.
        process = subprocess.Popen(
            command, env=ENGINE_ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, text=True
        )
    try:
        status, body = _first_answer(f"{base}/health", process, within_s=10)
        assert status == 503 and body["status"] == "starting", body
        status, body, retry_after = _get(f"{base}/v1/models")
        assert status == 503 and retry_after is not None and body["error"]["code"] == "starting"
        deadline = time.monotonic() + 600
        while (answer := _get(f"{base}/health"))[0] != 200:
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        startup = answer[1]["startup"]
        assert startup["phase"] == "started" and startup["ready_s"] > 0
        assert {"artefacts", "engine_load"} <= set(startup["phases_s"])
        # The first 200 already follows the engine's KV events: the subscription joined, and the
        # fresh engine's empty replay says its cache is as empty as the mirror.
        assert [replica["kv_mirror"] for replica in answer[1]["replicas"]] == ["exact"], answer[1]
        stopped_at = time.monotonic()
        # SIGINT to the service (kill -INT; a terminal's Ctrl-C also reaches vLLM's own processes,
        # see docs/service.md "Stopping"), nothing in flight.
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, log_path.read_text()[-3000:]
        assert time.monotonic() - stopped_at <= 10, log_path.read_text()[-3000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    output = log_path.read_text()
    run_logs = "".join(path.read_text() for path in (data_dir / "run").glob(f"serve-{process.pid}.log"))
    for noise in DISORDER:
        assert noise not in output + run_logs, (output + run_logs)[-3000:]


def test_batch_writes_only_json_lines_to_standard_output(tiny_assets: Assets, tmp_path: Path) -> None:
    data_dir = tiny_assets.store.path.parent.parent
    questions = tmp_path / "questions.txt"
    questions.write_text(f"{QUESTION}\nWhat does assert do under -O?\n", encoding="utf-8")
    command = [sys.executable, "-m", "specrag", "--data-dir", str(data_dir), "batch", str(questions)]
    command += ["--model", str(tiny_assets.model_dir), "--eager", "-k", "2", "--max-tokens", "2"]
    result = subprocess.run(
        command, env=ENGINE_ENV, capture_output=True, text=True, timeout=900, check=False, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout[-3000:]
    assert [json.loads(line)["query"] for line in lines] == [QUESTION, "What does assert do under -O?"]
    logged = result.stderr + "".join(path.read_text() for path in (data_dir / "run").glob("batch-*.log"))
    for noise in DISORDER:  # the engine stops in order at the end of a batch too
        assert noise not in logged, logged[-3000:]
