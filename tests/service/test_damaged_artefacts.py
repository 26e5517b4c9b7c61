"""A damaged document store row reaches no prompt: the query gets a clear 503, never a 500 nor
an answer computed from different tokens. Simulated engine: milliseconds."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import aiohttp
import numpy as np

from specrag.pipeline.store.document_store import DocumentStore
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import QUESTION, A, make_controller, scripted_index
from tests.helpers.http import running
from tests.helpers.models import store_of


def damage_row(path: Path, row: int) -> tuple[int, ...]:
    """Flip one bit in the middle of ``row``'s token data on disk; the tokens it now reads as."""
    with sqlite3.connect(path) as connection:
        (blob,) = connection.execute("SELECT tokens FROM passages WHERE row = ?", (row,)).fetchone()
    data = bytearray(path.read_bytes())
    at = data.index(blob) + len(blob) // 2
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    return tuple(int(t) for t in np.frombuffer(bytes(data[at - len(blob) // 2 : at + len(blob) // 2]), "<u4"))


def contains(sequence: list[int], part: tuple[int, ...]) -> bool:
    return any(tuple(sequence[i : i + len(part)]) == part for i in range(len(sequence) - len(part) + 1))


async def test_a_flipped_byte_in_a_store_row_is_a_503_and_reaches_no_prompt(
    tiny_assets: Assets, tmp_path: Path
) -> None:
    path = tmp_path / "store.sqlite"
    store_of(path, tiny_assets.passages, tiny_assets.tokenizer).close()
    damaged_tokens = damage_row(path, A[0])
    assets = dataclasses.replace(tiny_assets, store=DocumentStore(path))
    engine = SimulatedEngine(time_scale=0.05, max_model_len=4096)
    controller = make_controller(engine, assets, scripted_index(assets, [A]))
    async with running(controller) as url, aiohttp.ClientSession() as http:
        for mode in ("serial", "speculation"):
            async with http.post(f"{url}/v1/rag", json={"query": QUESTION, "k": 4, "mode": mode}) as response:
                body = await response.json()
                assert response.status == 503, body
                assert body["error"]["code"] == "artifact_damaged"
                assert str(path) not in body["error"]["message"]  # the path is for the operator's log
    await engine.close()
    prompts = [request.tokens for request in engine._requests.values()]
    assert not any(contains(prompt, damaged_tokens[:8]) for prompt in prompts)
