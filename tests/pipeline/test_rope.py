"""RoPE as a rotation: our rotation and shift against Hugging Face's Llama RoPE (the reference)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from specrag.errors import InvalidInputError
from specrag.pipeline.document_kv.rope import RopeSpec

HEAD_DIM, THETA = 64, 100000.0  # the real default model's (SmolLM2-135M)


def reference_rope(raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Hugging Face's Llama RoPE of ``raw`` keys ``[heads, tokens, dim]`` at ``positions``."""
    config = LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        rope_parameters={"rope_type": "default", "rope_theta": THETA},
        max_position_embeddings=65536,
    )
    cos, sin = LlamaRotaryEmbedding(config)(raw, positions[None, :])
    _, keys = apply_rotary_pos_emb(raw[None], raw[None], cos, sin)
    return keys[0]


@pytest.fixture
def raw() -> torch.Tensor:
    return torch.randn(3, 50, HEAD_DIM, generator=torch.Generator().manual_seed(0))


def test_rotate_is_the_reference_rope(raw: torch.Tensor) -> None:
    positions = torch.arange(7, 57)
    expected = reference_rope(raw, positions)
    assert torch.allclose(RopeSpec(HEAD_DIM, THETA).rotate(raw, positions), expected, atol=1e-5)


@pytest.mark.parametrize("offset", [1, 37, 1000, 7000])
def test_shift_moves_keys_to_later_positions(raw: torch.Tensor, offset: int) -> None:
    """Keys computed at 0..n-1, shifted by p, are the keys the reference computes at p..p+n-1."""
    positions = torch.arange(raw.shape[1])
    stored = reference_rope(raw, positions)
    shifted = RopeSpec(HEAD_DIM, THETA).shift(stored, offset)
    expected = reference_rope(raw, positions + offset)
    # The reference computes its angles in float32 (ours in float64): ~1e-7 * position apart.
    assert torch.allclose(shifted, expected, atol=1e-4 + 1e-7 * offset * 4)
    assert not torch.allclose(stored, expected, atol=1e-2)  # the shift is not a no-op


def test_shift_keeps_the_dtype_and_inverts(raw: torch.Tensor) -> None:
    rope = RopeSpec(HEAD_DIM, THETA)
    keys = raw.to(torch.bfloat16)
    moved = rope.shift(keys, 300)
    assert moved.dtype == torch.bfloat16
    assert torch.allclose(rope.shift(moved, -300).float(), keys.float(), atol=3e-2)
    assert rope.shift(keys, 0) is keys


def test_spec_from_configs() -> None:
    old = {"hidden_size": 576, "num_attention_heads": 9, "rope_theta": 100000.0}
    assert RopeSpec.from_config(old) == RopeSpec(64, 100000.0)
    new = {
        "head_dim": 32,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "rope_parameters": {"rope_theta": 5e5},
    }
    assert RopeSpec.from_config(new) == RopeSpec(32, 5e5)
    with pytest.raises(InvalidInputError, match="plain RoPE"):
        RopeSpec.from_config({**old, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(InvalidInputError, match="whole head"):
        RopeSpec.from_config({**old, "partial_rotary_factor": 0.5})
    with pytest.raises(InvalidInputError, match="even"):
        RopeSpec(63, 1e4)
