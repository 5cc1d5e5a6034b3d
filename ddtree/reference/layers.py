"""Small building blocks of the reference: RMSNorm and the SwiGLU MLP (docs/kimi-k2.md section 5.1).

Everything runs in the dtype of its inputs (float64 in the reference), so "compute the norm in
fp32" of the bf16 engines is exceeded, not imitated.
"""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [..., D] -> weight * x / sqrt(mean(x^2) + eps)."""
    mean_square = np.mean(x * x, axis=-1, keepdims=True)               # [..., 1]
    return weight * (x / np.sqrt(mean_square + eps))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """x [n, D], gate/up [I, D], down [D, I] -> down(silu(gate x) * up x) [n, D]."""
    hidden = silu(x @ gate.T) * (x @ up.T)                             # [n, I]
    return hidden @ down.T                                             # [n, D]
