"""Where a Ray replica's engine publishes its KV events (no Ray cluster, no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrag.pipeline.config import EngineConfig

pytest.importorskip("ray")


@pytest.mark.parametrize("replay", [True, False])
def test_a_replicas_kv_events_bind_its_node_not_every_interface(replay: bool, tmp_path: Path) -> None:
    """The actor binds where its caller subscribes, and never ``*``."""
    from specrag.pipeline.ray_engine import on_node, replica_config, subscriber_config

    config = replica_config(EngineConfig(model=str(tmp_path)), 1, 5600, cpus=2)
    if not replay:
        config = config.with_overrides(kv_events_replay_endpoint=None)
    bound = on_node(config, "10.1.2.3")
    assert bound.kv_events_endpoint == "tcp://10.1.2.3:5600"
    assert bound.kv_events_replay_endpoint == ("tcp://10.1.2.3:5601" if replay else None)
    assert bound.kv_events_topic == "kv-1"
    if replay:
        source = subscriber_config(config, "10.1.2.3")
        assert source.endpoint == bound.kv_events_endpoint
        assert source.replay_endpoint == bound.kv_events_replay_endpoint
    without_events = EngineConfig(model=str(tmp_path))
    assert on_node(without_events, "10.1.2.3") == without_events  # nothing to bind: as it is
