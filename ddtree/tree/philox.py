"""Philox4x32-10, the counter-based generator behind the sampling noise (docs/interfaces.md section 5).

Salmon, Moraes, Dror, Shaw, "Parallel Random Numbers: As Easy as 1, 2, 3" (SC11); constants and
round structure as in D. E. Shaw Research's Random123 `philox.h`. A pure function of a 128-bit
counter and a 64-bit key, so every backend (numpy here, CUDA kernels later) draws the same noise
for the same (seed, position, token) without any generator state.

One round on the counter (c0, c1, c2, c3) with key (k0, k1):
    (hi0, lo0) = M0 * c0,  (hi1, lo1) = M1 * c2          (32x32 -> 64-bit products)
    c <- (hi1 ^ c1 ^ k0,  lo1,  hi0 ^ c3 ^ k1,  lo0)
and the key is bumped by the Weyl constants (W0, W1) before every round after the first.
"""
from __future__ import annotations

import numpy as np

PHILOX_M0 = np.uint64(0xD2511F53)
PHILOX_M1 = np.uint64(0xCD9E8D57)
PHILOX_W0 = np.uint64(0x9E3779B9)
PHILOX_W1 = np.uint64(0xBB67AE85)
ROUNDS = 10
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


def _as_u32_lanes(a, lanes: int, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.shape[-1:] != (lanes,):
        raise ValueError(f"philox4x32_10: {what} must have a last axis of {lanes} 32-bit words, "
                         f"got shape {list(a.shape)}")
    if a.dtype.kind not in "iu":
        raise TypeError(f"philox4x32_10: {what} must be integers, got {a.dtype}")
    if a.size and (a.min() < 0 or a.max() > 0xFFFFFFFF):
        raise ValueError(f"philox4x32_10: {what} words must be in [0, 2^32)")
    return a.astype(np.uint64)


def philox4x32_10(counter, key) -> np.ndarray:
    """counter [..., 4], key [..., 2] (32-bit words, broadcastable) -> [..., 4] uint32."""
    c = _as_u32_lanes(counter, 4, "counter")
    k = _as_u32_lanes(key, 2, "key")
    c0, c1, c2, c3 = c[..., 0], c[..., 1], c[..., 2], c[..., 3]
    k0, k1 = k[..., 0], k[..., 1]
    for r in range(ROUNDS):
        if r:
            k0 = (k0 + PHILOX_W0) & _LOW32
            k1 = (k1 + PHILOX_W1) & _LOW32
        p0 = PHILOX_M0 * c0                      # < 2^64: exact in uint64
        p1 = PHILOX_M1 * c2
        c0, c1, c2, c3 = ((p1 >> _SHIFT32) ^ c1 ^ k0, p1 & _LOW32,
                          (p0 >> _SHIFT32) ^ c3 ^ k1, p0 & _LOW32)
    return np.stack(np.broadcast_arrays(c0, c1, c2, c3), axis=-1).astype(np.uint32)
