"""bfloat16 without torch: numpy has no bf16 dtype, so bf16 tensors travel as their uint16 bits.

safetensors' numpy API cannot read or write BF16, so the checkpoint reader/writer parse the
format themselves and hand bf16 tensors to numpy code as uint16 bit patterns; these functions
convert. f32 -> bf16 rounds to nearest even, as torch does. `as_float` is the one rule for a tensor
that may be either: uint16 means bf16 bits, anything else is already a number.
"""
from __future__ import annotations

import numpy as np


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16_to_f32: expected uint16 bit patterns, got {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 (or anything castable) -> uint16 bf16 bits, round to nearest even; NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, np.uint16(0x7FC0), rounded)
    return rounded


def as_float(a: np.ndarray, dtype=np.float32) -> np.ndarray:
    """A tensor as floats of `dtype`: uint16 is bf16 bits (converted exactly), anything else is cast.
    Returns `a` itself (no copy) when it already has `dtype`."""
    a = np.asarray(a)
    if a.dtype == np.uint16:
        a = bf16_to_f32(a)
    return a.astype(dtype, copy=False)
