"""The connector's pure parts: which spans a request may claim, and reading the CPU block layout."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops

from specrag.pipeline.document_kv.connector import BlockLayout, claim_plan
from specrag.pipeline.document_kv.store import segment_key

TOKENS = list(range(100, 200))  # system 0-32, doc A 32-64, doc B 64-96, question 96-100
SPANS = [[0, 32], [32, 64], [64, 96]]


def stored(*spans: list[int]) -> set[str]:
    return {segment_key(TOKENS[start:end]) for start, end in spans}


def test_claims_every_span_beyond_the_cached_prefix() -> None:
    everything = stored(*SPANS)
    plan = claim_plan(TOKENS, SPANS, 0, everything.__contains__)
    assert plan == [(segment_key(TOKENS[s:e]), s, e) for s, e in SPANS]
    behind_cache = claim_plan(TOKENS, SPANS, 40, everything.__contains__)
    assert behind_cache is not None and [start for _, start, _ in behind_cache] == [32, 64]


def test_claims_nothing_when_anything_is_missing() -> None:
    assert claim_plan(TOKENS, SPANS, 0, stored(SPANS[0], SPANS[2]).__contains__) is None
    # Spans already in the prefix cache need not be stored.
    assert claim_plan(TOKENS, SPANS, 64, stored(SPANS[2]).__contains__) is not None
    everything = stored(*SPANS).__contains__
    assert claim_plan(TOKENS, [[0, 32], [40, 64]], 0, everything) is None  # a gap
    assert claim_plan(TOKENS, SPANS, 96, everything) is None  # all cached already
    assert claim_plan(TOKENS[:96], SPANS, 0, everything) is None  # nothing left to compute
    assert claim_plan(TOKENS, [], 0, everything) is None


def test_documents_after_the_prefix_are_looked_up_as_computed_after_it() -> None:
    expected = [(segment_key(TOKENS[0:32]), 0, 32)] + [
        (segment_key(TOKENS[s:e], prefix=TOKENS[:32]), s, e) for s, e in SPANS[1:]
    ]
    after = {key for key, _, _ in expected}.__contains__
    assert claim_plan(TOKENS, SPANS, 0, after, prefix=32) == expected
    assert claim_plan(TOKENS, SPANS, 0, stored(*SPANS).__contains__, prefix=32) is None  # alone: not these
    assert claim_plan(TOKENS, SPANS, 0, after) is None  # and the other way round


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_layout_reads_what_the_backend_op_wrote(dtype: torch.dtype) -> None:
    blocks, heads, block_size, head_dim = 6, 3, 32, 64
    cache = torch.zeros(blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    slots = torch.tensor([70, 71, 72, 5, 190, 191])
    keys = torch.randn(len(slots), heads, head_dim).to(dtype)
    values = torch.randn(len(slots), heads, head_dim).to(dtype)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec")
    layout = BlockLayout(dtype, block_size, head_dim, "vec")
    read = layout.read(cache, slots)  # [2, heads, tokens, dim]
    assert torch.equal(read[0], keys.transpose(0, 1))
    assert torch.equal(read[1], values.transpose(0, 1))
