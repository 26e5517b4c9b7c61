"""Rotary position embedding (RoPE) as a rotation, so stored keys can move to another position.

A key cached by a Llama-family model is ``R(p) k``: the raw key rotated by an angle proportional to
its position ``p``, pair of dimensions by pair of dimensions. Rotations compose, ``R(q) R(p) =
R(p + q)``, so a key computed at position ``p`` becomes the key the model would have computed at
``p + q`` by one more rotation by ``q``, with no need to know the raw key. That is TurboRAG's
"reordered positions": a document's KV computed alone at a fixed start is placed anywhere in a
prompt. Values carry no position and are used as they are.

Only the plain RoPE of Llama-style configs is supported (``rope_type`` default, every dimension
rotated, "NeoX" half-split pairing as vLLM and Hugging Face use for Llama); anything else is
refused rather than rotated wrongly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from specrag.errors import InvalidInputError

__all__ = ["DEFAULT_ROPE_THETA", "RopeSpec"]

DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeSpec:
    """What the rotation needs: the per-head key size and the frequency base."""

    head_dim: int
    theta: float

    def __post_init__(self) -> None:
        if self.head_dim < 2 or self.head_dim % 2:
            raise InvalidInputError(f"RoPE needs an even head size, got {self.head_dim}")
        if self.theta <= 0:
            raise InvalidInputError(f"RoPE base must be positive, got {self.theta}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RopeSpec:
        """The spec of a Hugging Face ``config.json`` (either transformers' old or new rope keys)."""
        parameters = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or {}
        rope_type = (
            parameters.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        )
        if rope_type != "default":
            raise InvalidInputError(f"document KV supports plain RoPE only, this model uses {rope_type!r}")
        if float(config.get("partial_rotary_factor", 1.0)) != 1.0:
            raise InvalidInputError("document KV supports RoPE over the whole head only")
        theta = parameters.get("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA))
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return cls(head_dim=int(head_dim), theta=float(theta))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every (position, frequency) pair, float64 for exact small angles."""
        half = self.head_dim // 2
        inv_freq = self.theta ** (-torch.arange(half, dtype=torch.float64) * 2 / self.head_dim)
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        return angles.cos(), angles.sin()

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``keys`` (``[..., tokens, head_dim]``) rotated by ``positions`` (``[tokens]``).

        Applied to raw keys this is RoPE itself; applied to cached keys it shifts them by
        ``positions``. Computed in float32 (float64 angles) and returned in the keys' dtype.
        """
        if keys.shape[-1] != self.head_dim:
            raise InvalidInputError(f"keys have head size {keys.shape[-1]}, RoPE expects {self.head_dim}")
        if positions.shape != keys.shape[-2:-1]:
            raise InvalidInputError(f"{positions.shape[0]} positions for {keys.shape[-2]} keys")
        cos, sin = (part.to(torch.float32) for part in self.cos_sin(positions))
        half = self.head_dim // 2
        x = keys.to(torch.float32)
        first, second = x[..., :half], x[..., half:]
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        return rotated.to(keys.dtype)

    def shift(self, keys: torch.Tensor, by: int) -> torch.Tensor:
        """Cached keys moved ``by`` positions later (negative: earlier); ``by == 0`` returns them."""
        if by == 0:
            return keys
        return self.rotate(keys, torch.full((keys.shape[-2],), by, dtype=torch.int64))
