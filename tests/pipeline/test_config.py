"""Engine configuration: validation names the bad field; the environment it exports."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from specrag.errors import InvalidInputError
from specrag.pipeline.commands import engine_server_config
from specrag.pipeline.engines.config import VLLM_ENVIRONMENT_DEFAULTS, EngineConfig
from specrag.pipeline.models.directory import model_context_length
from specrag.pipeline.models.dtype import cpu_has_native_bf16, resolve_dtype
from specrag.service.run.options import ServiceOptions, base_engine_config
from specrag.service.run.pools import free_port_pair


def test_defaults_validate_for_an_existing_model_dir(tmp_path: Path) -> None:
    config = EngineConfig(model=str(tmp_path)).validate()
    assert config.block_size == 32
    assert config.process_environment() == {**VLLM_ENVIRONMENT_DEFAULTS, "VLLM_CPU_KVCACHE_SPACE": "2"}


def test_the_compile_cache_is_one_vllm_can_load_back_unless_the_environment_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's AOT compile cache fails to load on its CPU build (every start compiled again)."""
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    config = EngineConfig(model=str(tmp_path))
    assert config.process_environment()["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert config.process_environment()["VLLM_USE_AOT_COMPILE"] == "1"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_model_len": 0}, "max_model_len must be positive"),
        ({"kv_cache_gib": -1}, "kv_cache_gib must be positive"),
        ({"max_num_seqs": 0}, "max_num_seqs must be positive"),
        ({"block_size": 48}, "block_size must be a power of two"),
        ({"block_size": 0}, "block_size must be a power of two"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"startup_timeout_s": 0}, "startup_timeout_s"),
    ],
)
def test_invalid_fields_are_named(tmp_path: Path, changes: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        EngineConfig(model=str(tmp_path)).with_overrides(**changes)


def test_missing_model_dir_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="model directory not found"):
        EngineConfig(model=str(tmp_path / "nope")).validate()
    with pytest.raises(InvalidInputError, match="'model'"):
        EngineConfig(model="").validate()


def test_environment_for_binding_and_long_contexts(tmp_path: Path) -> None:
    config = EngineConfig(model=str(tmp_path), omp_threads_bind="1", max_model_len=16384, kv_cache_gib=4)
    assert config.process_environment() == {
        **VLLM_ENVIRONMENT_DEFAULTS,
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": "1",
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
    }


AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize(
    ("cpuinfo", "native"), [(AVX2_ONLY, False), (SAPPHIRE_RAPIDS, True), (GRAVITON3, True), ("", False)]
)
def test_native_bf16_is_read_from_the_cpu_flags(cpuinfo: str, native: bool) -> None:
    assert cpu_has_native_bf16(cpuinfo) is native


def test_auto_dtype_is_float32_only_on_a_cpu_that_would_emulate_bf16() -> None:
    assert resolve_dtype("auto", on_cpu=True, cpuinfo=AVX2_ONLY) == "float32"
    assert resolve_dtype("auto", on_cpu=True, cpuinfo=SAPPHIRE_RAPIDS) == "auto"
    assert resolve_dtype("auto", on_cpu=False, cpuinfo=AVX2_ONLY) == "auto"  # a GPU decides itself
    assert resolve_dtype("bfloat16", on_cpu=True, cpuinfo=AVX2_ONLY) == "bfloat16"  # asked for: kept


def test_the_server_command_carries_every_engine_argument(tmp_path: Path) -> None:
    config = engine_server_config(str(tmp_path), eager=True, kv_events_port=5557)
    command, environment = config.server_command("127.0.0.1", 8123, on_cpu=True)
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(command)
    for expected in (
        "--port 8123",
        "--block-size 32",
        "--max-num-batched-tokens 512",
        "--long-prefill-token-threshold 256",
        "--enable-prefix-caching",
        "--enforce-eager",
        "--enable-prompt-tokens-details",
    ):
        assert expected in flags
    events = json.loads(command[command.index("--kv-events-config") + 1])
    # Bound on the server's host (loopback by default), not on every interface.
    assert events["endpoint"] == "tcp://[::ffff:127.0.0.1]:5557"
    assert events["replay_endpoint"] == "tcp://[::ffff:127.0.0.1]:5558"
    assert environment["VLLM_CPU_KVCACHE_SPACE"] == "2"
    # Every engine argument the in-process engine gets is on the server's command line too.
    for name in config.engine_arguments(on_cpu=True):
        assert "--" + name.replace("_", "-") in command or "--no-" + name.replace("_", "-") in command


def test_a_compiled_engine_is_asked_for_explicitly(tmp_path: Path) -> None:
    command, _ = engine_server_config(str(tmp_path), eager=False, kv_events_port=None).server_command(
        "127.0.0.1", 8000, on_cpu=True
    )
    assert "--no-enforce-eager" in command and "--kv-events-config" not in command


@pytest.mark.parametrize(
    ("host", "bound"),
    [("127.0.0.1", "tcp://127.0.0.1:"), ("localhost", "tcp://127.0.0.1:"), ("0.0.0.0", "tcp://0.0.0.0:")],
)
def test_the_kv_events_publisher_binds_the_host_it_is_told(tmp_path: Path, host: str, bound: str) -> None:
    """As vLLM's publisher treats the endpoint: bound (not connected to), on that host only."""
    import zmq
    from vllm.distributed.kv_events import ZmqEventPublisher

    port = free_port_pair()
    config = engine_server_config(str(tmp_path), eager=True, kv_events_port=port, kv_events_host=host)
    assert config.kv_events_endpoint is not None and config.kv_events_replay_endpoint is not None
    for endpoint, expected_port in (
        (config.kv_events_endpoint, port),
        (config.kv_events_replay_endpoint, port + 1),
    ):
        assert ZmqEventPublisher._is_bind_endpoint(endpoint), endpoint
        context = zmq.Context()
        socket = context.socket(zmq.PUB)
        try:
            socket.bind(endpoint.replace("*", "0.0.0.0"))
            assert socket.getsockopt_string(zmq.LAST_ENDPOINT) == f"{bound}{expected_port}"
        finally:
            socket.close(linger=0)
            context.term()


def test_a_kv_events_host_without_an_ipv4_address_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="KV events need an IPv4 host"):
        engine_server_config(
            str(tmp_path), eager=True, kv_events_port=6000, kv_events_host="no-such-host.invalid"
        )


@pytest.mark.parametrize("port", [0, 65535])
def test_a_kv_events_port_without_room_for_its_replay_port_is_refused(tmp_path: Path, port: int) -> None:
    with pytest.raises(InvalidInputError, match="--kv-events-port must be between 1 and 65534"):
        engine_server_config(str(tmp_path), eager=True, kv_events_port=port)


def test_a_replica_keeps_an_explicit_core_binding_and_otherwise_gets_its_own(tmp_path: Path) -> None:
    base = EngineConfig(model=str(tmp_path))
    assert base.pinned_to(1).omp_threads_bind == "1"
    assert replace(base, omp_threads_bind="0-1").pinned_to(1).omp_threads_bind == "0-1"


@pytest.mark.parametrize(
    ("config", "length"),
    [
        ({"max_position_embeddings": 2048}, 2048),  # Llama, Mistral, Qwen
        ({"n_positions": 1024, "n_embd": 768}, 1024),  # GPT-2
        ({"max_position_embeddings": 4096, "seq_length": 2048}, 2048),  # the shorter of two
        ({"hidden_size": 64}, None),
        ([1, 2], None),
    ],
)
def test_a_model_s_context_length_is_read_from_its_config(
    tmp_path: Path, config: object, length: int | None
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert model_context_length(tmp_path) == length


def test_an_unreadable_model_config_has_no_context_length(tmp_path: Path) -> None:
    assert model_context_length(tmp_path) is None
    (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
    assert model_context_length(tmp_path) is None


def test_the_service_s_engine_never_asks_for_more_context_than_the_model_has(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}), encoding="utf-8")
    assert base_engine_config(tmp_path, ServiceOptions()).max_model_len == 2048
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 131072}), encoding="utf-8")
    assert base_engine_config(tmp_path, ServiceOptions()).max_model_len == EngineConfig.max_model_len


def test_kv_cache_tokens_become_whole_blocks_plus_vllms_null_block(tmp_path: Path) -> None:
    config = engine_server_config(str(tmp_path), eager=True, kv_events_port=None, kv_cache_tokens=16384 + 1)
    assert config.engine_arguments(on_cpu=True)["num_gpu_blocks_override"] == 16384 // 32 + 1 + 1
    command, _ = config.server_command("127.0.0.1", 8123, on_cpu=True)
    assert command[command.index("--num-gpu-blocks-override") + 1] == "514"
    assert "num_gpu_blocks_override" not in EngineConfig(model=str(tmp_path)).engine_arguments(on_cpu=True)
    options = ServiceOptions(kv_cache_tokens=9000)
    blocks = base_engine_config(tmp_path, options).with_overrides().kv_cache_blocks()
    assert blocks == 282 + 1  # ceil(9000 / 32) + 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kv_cache_tokens": 0}, "--kv-cache-tokens) must be a positive integer: 0"),
        ({"kv_cache_tokens": 2.5}, "must be a positive integer: 2.5"),
        ({"kv_cache_tokens": 8191}, "must hold at least one prompt of max_model_len (8192 tokens"),
        ({"kv_cache_tokens": 9000, "block_size": None}, "kv_cache_tokens needs a block_size"),
    ],
)
def test_a_kv_cache_too_small_for_one_prompt_is_refused(
    tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        EngineConfig(model=str(tmp_path)).with_overrides(**changes)
