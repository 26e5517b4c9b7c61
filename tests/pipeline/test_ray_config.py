"""Where a Ray replica's engine publishes its KV events (no Ray cluster, no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrag.pipeline.engines.config import EngineConfig

pytest.importorskip("ray")


def test_a_replicas_kv_events_bind_its_node_not_every_interface(tmp_path: Path) -> None:
    """The actor binds its node's address (written the way vLLM's publisher binds rather than
    connects: IPv4-mapped) and the caller subscribes there; never ``*``."""
    from specrag.pipeline.engines.ray_engine import on_node, replica_config, subscriber_config

    config = replica_config(EngineConfig(model=str(tmp_path)), 1, 5600, cpus=2)
    assert config.kv_events_endpoint == "tcp://*:5600"  # open until the actor knows its node
    bound = on_node(config, "10.1.2.3")
    assert bound.kv_events_endpoint == "tcp://[::ffff:10.1.2.3]:5600"
    assert bound.kv_events_replay_endpoint == "tcp://[::ffff:10.1.2.3]:5601"
    assert bound.kv_events_topic == "kv-1"
    source = subscriber_config(config, "10.1.2.3")
    assert (source.endpoint, source.replay_endpoint, source.topic) == (
        "tcp://10.1.2.3:5600",
        "tcp://10.1.2.3:5601",
        "kv-1",
    )
    without_events = EngineConfig(model=str(tmp_path))
    assert on_node(without_events, "10.1.2.3") == without_events  # nothing to bind: as it is
