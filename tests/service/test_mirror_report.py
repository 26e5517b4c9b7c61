"""Each replica's KV mirror in /metrics and /health: exact or degraded, and the stream's counters."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp

from specrag.cache import BlockRemoved, KnowledgeTree
from specrag.pipeline.engines.config import KVEventSource
from specrag.pipeline.kv_mirror.mirror import KVMirror
from specrag.service.http.app import create_app, serving
from specrag.service.http.metrics import ServiceMetrics
from specrag.service.http.mirror_report import MIRROR_HEALTH, MirrorCollector, mirror_health
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import A, make_controller, scripted_index
from tests.helpers.kv_events import Publisher, hold_the_loop
from tests.helpers.tree import BLOCK, SYSTEM, FakeEngine, layout
from tests.helpers.waiting import wait_until

CAUGHT_UP = {"kv_mirror_lag_batches": 0, "kv_mirror_lag_seconds": 0.0}


def mirror(name: str) -> KVMirror:
    return KVMirror(KnowledgeTree(SYSTEM, block_size=BLOCK), KVEventSource("ipc:///unused"), name=name)


def test_each_replicas_state_and_counters_are_exported_at_scrape_time() -> None:
    exact, degraded = mirror("r0"), mirror("r1")
    metrics = ServiceMetrics()
    metrics.registry.register(MirrorCollector([exact, degraded]))
    exact.target.reset()
    events = FakeEngine().serve(layout((1,)))
    exact.target.apply([*events, *events[:1]])  # a second copy of the first block
    exact.target.apply([BlockRemoved((12345,))])  # never stored
    degraded.target.reset()
    degraded.target.degrade("lost KV event batches 2..3")
    text = metrics.exposition().decode()
    assert 'specrag_kv_mirror_exact{replica="r0"} 1.0' in text
    assert 'specrag_kv_mirror_exact{replica="r1"} 0.0' in text
    assert 'specrag_kv_mirror_duplicate_copies_total{replica="r0"} 1.0' in text
    assert 'specrag_kv_mirror_unknown_removals_total{replica="r0"} 1.0' in text
    assert 'specrag_kv_mirror_recoveries_total{replica="r1"} 0.0' in text
    assert mirror_health([exact, degraded]) == {
        "r0": {"kv_mirror": "exact", "kv_mirror_reason": None, **CAUGHT_UP},
        "r1": {"kv_mirror": "degraded", "kv_mirror_reason": "lost KV event batches 2..3", **CAUGHT_UP},
    }


async def test_health_reports_each_replicas_mirror(tiny_assets: Assets) -> None:
    engine = SimulatedEngine(block_size=32, time_scale=0.01)
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A], 0.01))
    name = controller.placement.replicas[0].name
    kv = mirror(name)
    kv.target.degrade("lost KV event batches 4..9")
    app = create_app(controller)
    app[MIRROR_HEALTH] = lambda: mirror_health([kv])
    try:
        async with (
            serving(app, access_log=False) as url,
            aiohttp.ClientSession() as http,
            http.get(f"{url}/health") as response,
        ):
            body = await response.json()
    finally:
        await controller.close()
        await engine.close()
    (replica,) = body["replicas"]
    assert replica["name"] == name and replica["kv_mirror"] == "degraded"
    assert replica["kv_mirror_reason"] == "lost KV event batches 4..9"


async def test_a_mirror_behind_its_events_exports_its_lag(tmp_path: Path) -> None:
    """Batches received while the loop is busy are behind until the loop applies them."""
    publisher = Publisher(tmp_path)
    source = KVEventSource(publisher.endpoint, publisher.replay_endpoint)
    kv = KVMirror(KnowledgeTree((1, 2, 3, 4), block_size=4), source, name="r0")
    metrics = ServiceMetrics()
    metrics.registry.register(MirrorCollector([kv]))
    try:
        await kv.start()
        assert kv.status.exact
        for seq in range(50):
            await publisher.publish(seq)
        hold_the_loop(1.0)  # received meanwhile, not applied
        text = metrics.exposition().decode()
        assert 'specrag_kv_mirror_lag_batches{replica="r0"} 50.0' in text
        seconds = re.search(r'specrag_kv_mirror_lag_seconds\{replica="r0"\} (\S+)', text)
        assert seconds is not None and float(seconds.group(1)) >= 0.5
        health = mirror_health([kv])["r0"]
        assert health["kv_mirror_lag_batches"] == 50
        await wait_until(lambda: kv.lag().batches == 0, what=lambda: f"{kv.lag()}")
        text = metrics.exposition().decode()
        assert 'specrag_kv_mirror_lag_batches{replica="r0"} 0.0' in text
        assert 'specrag_kv_mirror_lag_seconds{replica="r0"} 0.0' in text
    finally:
        await kv.stop()
        await publisher.close()
