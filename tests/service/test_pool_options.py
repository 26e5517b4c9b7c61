"""Which engines a service runs, and on which cores: bad combinations of pool or core options
fail before any engine starts, with a message naming the flags; the good ones say whether the
engines make a pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrag.cli import main
from specrag.errors import InvalidInputError
from specrag.service.run.assembly import ServiceOptions

URL_A, URL_B = "http://127.0.0.1:8001", "http://127.0.0.1:8002"
EVENTS_A, EVENTS_B = "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5567"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"replicas": 0}, "--replicas must be at least 1, got 0"),
        ({"replicas": -2, "ray_address": ""}, "--replicas must be at least 1, got -2"),
        ({"ray_address": "", "engine_urls": (URL_A,)}, "--ray and --engine-url exclude each other"),
        ({"replicas": 2, "engine_urls": (URL_A, URL_B)}, "to pool engine servers, repeat --engine-url"),
        ({"engine_urls": (URL_A, URL_A)}, "--engine-url given twice for the same engine: " + URL_A),
        ({"engine_kv_events": (EVENTS_A,)}, "--engine-kv-events needs --engine-url"),
        (
            {"engine_urls": (URL_A, URL_B), "engine_kv_events": (EVENTS_A,)},
            "one --engine-kv-events per --engine-url, in the same order: got 1 for 2 engines",
        ),
        (
            {"engine_urls": (URL_A, URL_B), "engine_kv_events": (EVENTS_A, EVENTS_A)},
            "--engine-kv-events given twice for the same engine",
        ),
        (
            {"engine_urls": (URL_A, URL_B), "engine_kv_events": (EVENTS_A, "ipc:///tmp/kv")},
            "must look like tcp://HOST:PORT",
        ),
        ({"router": "least_loaded"}, "--router needs several engines"),
        ({"router": "least_loaded", "engine_urls": (URL_A,)}, "--router needs several engines"),
        ({"engine_cpus": "0", "replicas": 2}, "--engine-cpus pins the one in-process engine"),
        ({"engine_cpus": "0", "engine_urls": (URL_A,)}, "--engine-cpus pins the one in-process engine"),
        ({"engine_cpus": "0", "ray_address": ""}, "--engine-cpus pins the one in-process engine"),
        ({"search_cpus": "1"}, "give --engine-cpus too, on other cores"),
        ({"search_cpus": "1", "replicas": 2}, "a pool of --replicas already takes one core per replica"),
        ({"engine_cpus": "0", "search_cpus": "0"}, "--engine-cpus and --search-cpus share cores [0]"),
        ({"engine_cpus": "zero"}, "--engine-cpus takes cores such as 0, 0,2 or 0-3, got 'zero'"),
        ({"engine_cpus": "1-0"}, "--engine-cpus '1-0' is not within this machine's cores"),
        ({"engine_urls": (URL_A,), "search_cpus": "4096"}, "--search-cpus '4096' is not within"),
        ({"engine_urls": (URL_A,), "kv_cache_tokens": 16384}, "give it to `specrag engine` for --engine-url"),
    ],
)
def test_a_bad_combination_is_refused_with_the_flags_named(options: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInputError) as refused:
        ServiceOptions(**options)  # type: ignore[arg-type]
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("options", "pooled"),
    [
        ({}, False),
        ({"engine_urls": (URL_A,), "engine_kv_events": (EVENTS_A,)}, False),
        ({"replicas": 2, "router": "round_robin"}, True),
        ({"engine_urls": (URL_A, URL_B), "engine_kv_events": (EVENTS_A, EVENTS_B)}, True),
        ({"engine_urls": (URL_A, URL_B)}, True),
        ({"ray_address": "", "router": "approx_prefix"}, True),
        ({"engine_cpus": "0", "search_cpus": "1"}, False),
        ({"engine_urls": (URL_A,), "search_cpus": "0"}, False),
    ],
)
def test_several_engines_or_ray_make_a_pool(options: dict[str, object], pooled: bool) -> None:
    assert ServiceOptions(**options).pooled is pooled  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "0"], "--replicas must be at least 1"),
        (["--ray", "--engine-url", URL_A], "--ray and --engine-url exclude each other"),
        (
            ["--engine-url", URL_A, "--engine-url", URL_B, "--engine-kv-events", EVENTS_A],
            "got 1 for 2 engines",
        ),
        (["--search-cpus", "1"], "give --engine-cpus too"),
    ],
)
def test_serve_exits_2_before_starting_anything(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["--data-dir", str(tmp_path), "serve", *argv]) == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error
    assert not any(tmp_path.iterdir())  # nothing was built or started
