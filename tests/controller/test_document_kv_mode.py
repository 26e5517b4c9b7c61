"""The document-KV choice (``document_kv``: full or turbo) through the controller, on a simulated
engine: checked, refused without a store, and turned into the prompt's spans on the engine request."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import pytest

from specrag.controller.controller import ControllerConfig
from specrag.controller.modes import DocumentKv
from specrag.controller.query import RagRequest
from specrag.errors import InvalidInputError, check_choice
from specrag.pipeline.engines.protocol import EngineOutput, Sampling
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import QUESTION, make_controller


class StoreEngine(SimulatedEngine):
    """A simulated engine that says it has a document KV store and keeps what it was asked."""

    def __init__(self) -> None:
        super().__init__(time_scale=0.01, max_model_len=4096)
        self.asked: list[tuple[tuple[int, ...], Sampling]] = []

    @property
    def supports_document_kv(self) -> bool:
        return True

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
    controller = make_controller(engine, tiny_assets, document_kv="turbo")
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
