"""RoPE on interleaved pairs with YaRN frequencies (docs/kimi-k2.md section 5.3).

Only the 64-d rope part of MLA rotates (the last qk_rope_head_dim dims of each q head and rows
kv_lora_rank.. of kv_a). Pairs are adjacent elements (2i, 2i+1) rotated by angle p * phi_i
(GPT-J style). HF de-interleaves and then uses rotate-half; the two are the same map.

Letters: d = qk_rope_head_dim, i = 0 .. d/2 - 1 the pair (frequency) index, p the absolute position.
"""
from __future__ import annotations

import numpy as np

from ddtree.model.config import RopeConfig
from ddtree.model.rope import rope_frequencies, rope_magnitude


class Rope:
    """Interleaved-pair rotary embedding for one rope config and dimension (float64 tables)."""

    def __init__(self, rope: RopeConfig, dim: int):
        if dim % 2:
            raise ValueError(f"Rope: dimension {dim} must be even")
        self.dim = dim
        self.freqs = rope_frequencies(rope, dim)                       # [d/2]
        self.magnitude = rope_magnitude(rope)

    def cos_sin(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """pos [q] int -> cos, sin [q, d/2] float64 (magnitude included)."""
        angle = np.asarray(pos, dtype=np.float64)[:, None] * self.freqs[None, :]   # [q, d/2]
        return np.cos(angle) * self.magnitude, np.sin(angle) * self.magnitude

    def apply(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Rotate x [q, ..., d] whose leading axis matches pos [q]; pairs (2i, 2i+1) turn by pos * phi_i."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"Rope.apply: last dim {x.shape[-1]} != rope dim {self.dim}")
        cos, sin = self.cos_sin(pos)                                   # [q, d/2]
        extra = (1,) * (x.ndim - 2)
        cos = cos.reshape(cos.shape[0], *extra, -1).astype(x.dtype)    # [q, 1.., d/2]
        sin = sin.reshape(sin.shape[0], *extra, -1).astype(x.dtype)
        even, odd = x[..., 0::2], x[..., 1::2]                         # [q, .., d/2] each
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out
