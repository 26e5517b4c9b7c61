"""What an IVF index says about itself: why a PQ build is refused, its codes, a single-stage index."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.local.staged_ivf import StagedIVF


def vectors(num: int, dim: int = 32) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((num, dim)).astype(np.float32)


def test_too_few_vectors_for_pq_names_the_cause_and_the_remedy() -> None:
    with pytest.raises(
        InvalidInputError, match=r"at least 9984 vectors .* has 500: use --kind ivf, or --pad-to"
    ):
        StagedIVF.build(vectors(500), codes="pq", pq_m=8)


def test_an_index_says_its_codes() -> None:
    assert StagedIVF.build(vectors(10_000), nlist=16, codes="pq", pq_m=8).settings["codes"] == "pq"
    assert StagedIVF.build(vectors(1_000), nlist=16, codes="sq8").settings["codes"] == "sq8"
    assert StagedIVF.build(vectors(1_000), nlist=16).settings["codes"] == "flat"


def test_unknown_codes_name_the_known_ones() -> None:
    with pytest.raises(InvalidInputError, match="unknown IVF codes 'sq4'; choose one of flat, pq, sq8"):
        StagedIVF.build(vectors(1_000), codes="sq4")


def test_an_index_of_one_probed_list_warns_that_it_cannot_stage(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="specrag.retrieval.backends.local.staged_ivf"):
        StagedIVF.build(vectors(60))  # fewer than 2 x 39 vectors: one list
    assert "a search is a single stage" in caplog.text
    assert "a corpus of 78+ passages" in caplog.text  # the threshold docs/service.md gives
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specrag.retrieval.backends.local.staged_ivf"):
        StagedIVF.build(vectors(78))  # two lists, both probed: two stages
    assert "single stage" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="specrag.retrieval.backends.local.staged_ivf"):
        StagedIVF.build(vectors(400))  # 10 lists, all probed (at least 32 by default): stages
    assert "single stage" not in caplog.text
