"""The document-KV choice (``document_kv``: full or turbo; its variant and tiers) through the
controller, on a simulated engine: checked, refused without a store, turned into the prompt's spans
on the engine request, and kept apart in the prefix cache and its mirror."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import pytest

from specrag.controller.controller import ControllerConfig
from specrag.controller.modes import DocumentKv
from specrag.controller.query import RagRequest
from specrag.errors import InvalidInputError, check_choice
from specrag.pipeline.engines.protocol import TURBO_CACHE_SALT_PREFIX, EngineOutput, Sampling
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import QUESTION, make_controller, pool_controller, simulated_pool


class StoreEngine(SimulatedEngine):
    """A simulated engine with document KV that keeps what it was asked."""

    def __init__(self) -> None:
        super().__init__(time_scale=0.01, max_model_len=4096, document_kv=True)
        self.asked: list[tuple[tuple[int, ...], Sampling]] = []

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: Sampling
    ) -> AsyncIterator[EngineOutput]:
        self.asked.append((tuple(prompt_token_ids), sampling))
        return super().generate(request_id, prompt_token_ids, sampling)


def test_choices_are_checked() -> None:
    assert check_choice("document_kv", "turbo", DocumentKv) == "turbo"
    with pytest.raises(InvalidInputError, match="choose one of full, turbo"):
        check_choice("document_kv", "fast", DocumentKv)
    with pytest.raises(InvalidInputError, match="document_kv"):
        ControllerConfig(document_kv="fast")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="ordered"):
        Sampling(document_kv=((10, 20), (15, 30)))


async def test_turbo_needs_an_engine_with_a_store(tiny_assets: Assets) -> None:
    controller = make_controller(SimulatedEngine(time_scale=0.01, max_model_len=4096), tiny_assets)
    with pytest.raises(InvalidInputError, match="--document-kv turbo"):
        controller.check(RagRequest(QUESTION, k=2, mode="serial", document_kv="turbo"))
    with pytest.raises(InvalidInputError, match="unknown document_kv"):
        controller.check(RagRequest(QUESTION, k=2, document_kv="sometimes"))
    assert not controller.check(RagRequest(QUESTION, k=2, document_kv="full")).document_kv


async def test_turbo_sends_the_system_prompt_and_documents_as_spans(tiny_assets: Assets) -> None:
    engine = StoreEngine()
    controller = make_controller(engine, tiny_assets, document_kv="turbo", document_kv_fresh=0)
    done = await controller.answer(RagRequest(QUESTION, k=3, mode="serial", max_tokens=2))
    prompt, sampling = engine.asked[-1]
    layout = done.prompt
    assert sampling.document_kv == layout.stored_spans()
    assert [end - start for start, end in sampling.document_kv] == [
        s.end - s.start for s in layout.segments if s.kind in ("system", "document")
    ]
    assert sampling.document_kv[-1][1] < len(prompt)  # the question is prefilled
    await controller.answer(RagRequest(QUESTION, k=3, mode="serial", max_tokens=2, document_kv="full"))
    assert engine.asked[-1][1].document_kv == ()


def test_fresh_documents_are_checked(tiny_assets: Assets) -> None:
    with pytest.raises(InvalidInputError, match="document_kv_fresh must be an integer between 0 and 50"):
        ControllerConfig(document_kv_fresh=-1)
    with pytest.raises(InvalidInputError, match="--document-kv-fresh"):
        ControllerConfig(document_kv_fresh=51, names={"document_kv_fresh": "--document-kv-fresh"})
    controller = make_controller(StoreEngine(), tiny_assets, document_kv="turbo")
    for bad in (-1, 4, True, "1", 1.0):
        with pytest.raises(InvalidInputError, match="document_kv_fresh must be an integer between 0 and 3"):
            controller.check(RagRequest(QUESTION, k=3, document_kv_fresh=bad))  # type: ignore[arg-type]
    assert controller.check(RagRequest(QUESTION, k=3, document_kv_fresh=3)).document_kv_fresh == 3
    assert controller.check(RagRequest(QUESTION, k=3, document_kv="full")).document_kv_fresh == 0
    capped = make_controller(StoreEngine(), tiny_assets, document_kv="turbo", document_kv_fresh=5)
    assert capped.check(RagRequest(QUESTION, k=2)).document_kv_fresh == 2  # the default: capped at k


@pytest.mark.parametrize("variant", ["alone", "after-system"])
async def test_tiers_load_the_lower_ranked_and_prefill_the_top_last(
    tiny_assets: Assets, variant: str
) -> None:
    engine = StoreEngine()
    controller = make_controller(engine, tiny_assets, document_kv="turbo", document_kv_variant=variant)
    request = RagRequest(QUESTION, k=3, mode="serial", max_tokens=2, document_kv_fresh=2)
    done = await controller.answer(request)
    _, sampling = engine.asked[-1]
    layout = done.prompt
    ranked = done.timeline.documents  # passage ids in retrieval rank
    placed = [tiny_assets.passages[int(row)].id for row in layout.document_ids()]
    assert placed == [ranked[2], ranked[0], ranked[1]]  # the top two last, in rank order
    documents = [s for s in layout.segments if s.kind == "document"]
    assert sampling.document_kv == layout.stored_spans(2)
    assert sampling.document_kv[-1][1] == documents[0].end  # the third-ranked loaded, the top two not
    system_end = layout.segments[0].end
    assert sampling.document_kv_prefix == (system_end if variant == "after-system" else 0)
    assert done.timeline.document_kv_tokens == documents[0].end  # cold: everything up to it loaded


async def test_salts_keep_tiers_variants_and_full_prefill_apart(tiny_assets: Assets) -> None:
    engine = StoreEngine()
    salts = {}
    for variant in ("alone", "after-system"):
        controller = make_controller(engine, tiny_assets, document_kv="turbo", document_kv_variant=variant)
        for fresh in (0, 1, 2):
            request = RagRequest(QUESTION, k=3, mode="serial", max_tokens=2, document_kv_fresh=fresh)
            await controller.answer(request)
            salts[variant, fresh] = engine.asked[-1][1].cache_salt
        await controller.answer(RagRequest(QUESTION, k=3, mode="serial", max_tokens=2, document_kv="full"))
        assert engine.asked[-1][1].cache_salt is None
    assert len(set(salts.values())) == len(salts)  # each computes other KV: none may reuse another's
    assert all(salt is not None and salt.startswith(TURBO_CACHE_SALT_PREFIX) for salt in salts.values())


async def test_the_mirror_keeps_loaded_blocks_apart_from_a_full_prefill(tiny_assets: Assets) -> None:
    (replica,) = simulated_pool(tiny_assets, 1, document_kv=True)
    controller = pool_controller([replica], tiny_assets, tiny_assets.index, document_kv="turbo")
    request = RagRequest(QUESTION, k=3, mode="serial", max_tokens=2, document_kv_fresh=1)
    turbo = await controller.answer(request)
    assert turbo.timeline.document_kv_tokens > 0
    assert replica.tree.prompt_hit(turbo.prompt) == 0  # salted blocks never predict a full prefill's hit
    again = await controller.answer(request)
    assert again.timeline.cached_prompt_tokens >= turbo.timeline.document_kv_tokens  # same tier: reused
    full = await controller.answer(replace(request, document_kv="full", request_id="full"))
    assert full.timeline.cached_prompt_tokens == 0  # nothing of the turbo requests' blocks served it
    assert replica.tree.prompt_hit(full.prompt) > 0  # the full prefill's own blocks are mirrored
