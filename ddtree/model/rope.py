"""The rotary frequency table of a RopeConfig (docs/kimi-k2.md section 5.3): per-pair angular frequencies,
YaRN-blended when the config says yarn, and the cos/sin magnitude. A definition of the model, shared by
the float64 oracle (reference/rope.py), the op set's numpy backend (ops/) and the torch training model;
each applies the rotation itself.

Letters: d = rotary dimension, i = 0 .. d/2 - 1 the pair (frequency) index.
"""
from __future__ import annotations

import math

import numpy as np

from ddtree.model.config import RopeConfig, yarn_mscale


def yarn_correction_dim(num_rotations: float, dim: int, base: float, original_max_pos: int) -> float:
    """corr(r) = d ln(L0 / (2 pi r)) / (2 ln b): the pair index that turns r times over L0 tokens."""
    return dim * math.log(original_max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_correction_range(rope: RopeConfig, dim: int) -> tuple[float, float]:
    """(low, high) pair indices of the YaRN ramp: pairs <= low keep theta_i, pairs >= high use theta_i / s."""
    L0 = rope.original_max_position_embeddings
    low = max(math.floor(yarn_correction_dim(rope.beta_fast, dim, rope.theta, L0)), 0)
    high = min(math.ceil(yarn_correction_dim(rope.beta_slow, dim, rope.theta, L0)), dim - 1)
    if low == high:
        high += 0.001          # avoid a zero-width ramp
    return float(low), float(high)


def rope_frequencies(rope: RopeConfig, dim: int) -> np.ndarray:
    """phi [dim/2] float64: per-pair angular frequency (radians per position), YaRN-blended if rope.type is yarn."""
    pair = np.arange(dim // 2, dtype=np.float64)                     # [d/2]
    theta = rope.theta ** (-2.0 * pair / dim)                         # [d/2] theta_i = b^(-2i/d)
    if rope.type != "yarn":
        return theta
    low, high = yarn_correction_range(rope, dim)
    gamma = np.clip((pair - low) / (high - low), 0.0, 1.0)            # [d/2] 0 keeps theta_i, 1 uses theta_i / s
    return theta * (1.0 - gamma) + (theta / rope.factor) * gamma


def rope_magnitude(rope: RopeConfig) -> float:
    """cos and sin are scaled by yarn_m(s, mscale) / yarn_m(s, mscale_all_dim) (1.0 for Kimi K2.x)."""
    if rope.type != "yarn":
        return 1.0
    return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
