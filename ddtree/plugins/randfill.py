"""Deterministic pseudo-random data, bit-identical in numpy and on the GPU (kernels/fill.cu).

word i of stream `seed` = (splitmix64((i + 1) * golden + (seed << 32)) >> 32) & mask | bits_or.
Benchmarks fill gigabytes of weights on the device without a host transfer; tests fill on the
device and compute references from the same words on the CPU (or from fixtures made that way).
"""
from __future__ import annotations

import numpy as np

# (mask, bits_or) presets, per 32-bit word
INT4_WORDS = (0xFFFFFFFF, 0)                 # 8 nibbles uniform in 0..15 -> q in [-8, 7]
SCALES_BF16 = (0x007F007F, 0x3B803B80)       # bf16 pairs in [2^-8, 2^-7)
ACT_BF16 = (0x81FF81FF, 0x3E003E00)          # bf16 pairs, random sign, |x| in [2^-3, 2)
WEIGHT_BF16 = (0x81FF81FF, 0x3A003A00)       # bf16 pairs, random sign, |w| in [2^-11, 2^-7)

_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def hash_u32(n: int, seed: int, mask: int = 0xFFFFFFFF, bits_or: int = 0, start: int = 0) -> np.ndarray:
    """Words start .. start + n - 1 of stream `seed` (numpy twin of fill_hash_u32, which writes words 0 ..)."""
    out = np.empty(n, dtype=np.uint32)
    step = 1 << 24
    with np.errstate(over="ignore"):
        for a in range(0, n, step):
            z = np.arange(start + a + 1, start + min(n, a + step) + 1, dtype=np.uint64) * _GOLDEN
            z += np.uint64((seed & 0xFFFFFFFF) << 32)
            z = (z ^ (z >> np.uint64(30))) * _M1
            z = (z ^ (z >> np.uint64(27))) * _M2
            z ^= z >> np.uint64(31)
            out[a:a + len(z)] = ((z >> np.uint64(32)).astype(np.uint32) & np.uint32(mask)) | np.uint32(bits_or)
    return out


def hash_array(shape, dtype, seed: int, preset=INT4_WORDS) -> np.ndarray:
    """An array of `shape` and 2- or 4-byte `dtype` whose bytes are hash_u32 words."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes % 4:
        raise ValueError(f"hash_array: {nbytes} bytes is not a whole number of 32-bit words")
    return hash_u32(nbytes // 4, seed, *preset).view(dtype).reshape(shape)


def fill_device(gpu, array, seed: int, preset=INT4_WORDS, stream=None) -> None:
    """Fill a DeviceArray with hash_array(array.shape, array.dtype, seed, preset), on the GPU."""
    if array.nbytes % 4:
        raise ValueError(f"fill_device: {array.nbytes} bytes is not a whole number of 32-bit words")
    n = array.nbytes // 4
    blocks = min(max(1, -(-n // 256)), 132 * 32)
    gpu.launch(gpu.kernel("fill.cu", "fill_hash_u32"), blocks, 256, 0, np.uint64(array.ptr), np.uint64(n),
               np.uint32(seed & 0xFFFFFFFF), np.uint32(preset[0]), np.uint32(preset[1]), stream=stream)
