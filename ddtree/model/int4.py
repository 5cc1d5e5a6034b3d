"""compressed-tensors `pack-quantized` INT4 (docs/kimi-k2.md section 4.2; docs/interfaces.md section 2).

A weight W[N, K] (y = x @ W.T) is stored as
  weight_packed [N, ceil(K/8)] int32   8 nibbles per word along K, lowest nibble = lowest column
  weight_scale  [N, K/group]   bf16    one scale per group of `group` input columns
  weight_shape  [2]            int32 or int64, = [N, K]
with nibble u = q + 8 (offset binary, q in [-8, 7]) and W[n, k] = (u[n, k] - 8) * scale[n, k // group].
This module is the only place that knows the packing; everything else calls it.
"""
from __future__ import annotations

import numpy as np

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16


def pack_int4(q: np.ndarray) -> np.ndarray:
    """q [N, K] signed ints in [-8, 7] -> weight_packed [N, ceil(K/8)] int32."""
    q = np.asarray(q)
    if q.ndim != 2:
        raise ValueError(f"pack_int4: expected a 2-D [N, K] array, got shape {q.shape}")
    if q.size and (q.min() < -8 or q.max() > 7):
        raise ValueError(f"pack_int4: values must be in [-8, 7], got [{q.min()}, {q.max()}]")
    n, k = q.shape
    kp = -(-k // 8) * 8
    u = np.zeros((n, kp), dtype=np.uint32)
    u[:, :k] = (q.astype(np.int64) + 8).astype(np.uint32)   # padding columns hold nibble 0
    u = u.reshape(n, kp // 8, 8)
    shifts = (np.arange(8, dtype=np.uint32) * 4)[None, None, :]
    words = np.bitwise_or.reduce(u << shifts, axis=2)         # [N, K/8] uint32
    return words.view(np.int32)


def unpack_int4(packed: np.ndarray, shape) -> np.ndarray:
    """weight_packed [N, K/8] int32 + weight_shape [N, K] -> q [N, K] int8 in [-8, 7]."""
    n, k = (int(x) for x in np.asarray(shape).reshape(-1))
    packed = np.asarray(packed)
    if packed.dtype != np.int32 or packed.shape != (n, -(-k // 8)):
        raise ValueError(f"unpack_int4: expected int32 [{n}, {-(-k // 8)}] for weight_shape [{n}, {k}], "
                         f"got {packed.dtype} {list(packed.shape)}")
    words = packed.view(np.uint32)[:, :, None]
    shifts = (np.arange(8, dtype=np.uint32) * 4)[None, None, :]
    u = ((words >> shifts) & 0xF).reshape(n, -1)[:, :k]
    return (u.astype(np.int8) - 8)


def quantize_int4(w: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric minmax quantisation of w [N, K] (float) -> (q [N, K] int8 in [-7, 7], scale [N, K/group] bf16 bits).

    Like the QAT checkpoints, only 15 levels are used (scale = max|w| / 7). The scale is rounded to
    bf16 first and q computed against the rounded scale, so dequantize(q, scale) is what the file holds.
    """
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    if k % group:
        raise ValueError(f"quantize_int4: group size {group} does not divide K = {k}")
    g = w.reshape(n, k // group, group)
    amax = np.abs(g).max(axis=2)
    scale_bits = f32_to_bf16(np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32))
    scale = bf16_to_f32(scale_bits)
    q = np.clip(np.rint(g / scale[:, :, None]), -7, 7).astype(np.int8).reshape(n, k)
    return q, scale_bits


def dequantize_int4(q: np.ndarray, scale_bits: np.ndarray, group: int = 32, dtype=np.float32) -> np.ndarray:
    """q [N, K] int8 + scale [N, K/group] bf16 bits (uint16) -> W [N, K] in `dtype` (exact in float32)."""
    n, k = q.shape
    if scale_bits.shape != (n, k // group):
        raise ValueError(f"dequantize_int4: scale shape {list(scale_bits.shape)} does not match "
                         f"[{n}, {k // group}] for W [{n}, {k}] with group {group}")
    s = bf16_to_f32(scale_bits).astype(dtype)
    return (q.astype(dtype).reshape(n, k // group, group) * s[:, :, None]).reshape(n, k)


def dequantize_packed(packed: np.ndarray, scale_bits: np.ndarray, shape, group: int = 32,
                      dtype=np.float32) -> np.ndarray:
    """The checkpoint's three tensors -> dense W [N, K]."""
    return dequantize_int4(unpack_int4(packed, shape), scale_bits, group, dtype)
