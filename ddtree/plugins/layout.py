"""INT4 expert weights in the MoE kernels' layout (numpy only; docs/interfaces.md section 2).

Input is the compressed-tensors format of ddtree/model/int4.py: weight_packed [N, K/8] int32 (8 nibbles
u = q + 8 per word along K, lowest nibble first), weight_scale [N, K/32] bf16 bits, y = x @ W.T.
The layout applies per rank, after the tensor-parallel slice.

Kernel layout of one INT4 matrix W [N, K] (N % 32 == 0, K % 64 == 0):
  words  [N/32, K/64, 2, 32, 4] int32   one uint4 per lane per (16-row tile, 64-wide k chunk); the two
                                        tiles of a pair sit together per chunk, so a warp that streams
                                        a tile pair reads one contiguous 1 KB block per step
  scales [N/32, K/64, 2, 8, 4]  bf16    per tile and row group g: (row g, k32 group 0), (row g+8,
                                        group 0), (row g, group 1), (row g+8, group 1)
Lane = 4 g + t (the mma.m16n8k16 fragment indices). Word s = 2 h + u of lane (g, t) holds the eight
weights a lane feeds to mma step s: rows g and g + 8 at chunk columns p .. p + 3 with p = 32 h + 8 t + 4 u.
The mma's logical k (2t, 2t+1, 2t+8, 2t+9) is mapped to these physical columns, and the kernels read
the activations in the same order, so the k permutation cancels. Nibble positions inside the word:
  nibble 0, 4: row g,   columns p, p+1      -> A register 0 (low, high half)
  nibble 1, 5: row g+8, columns p, p+1      -> A register 1
  nibble 2, 6: row g,   columns p+2, p+3    -> A register 2
  nibble 3, 7: row g+8, columns p+2, p+3    -> A register 3
so register j = (word >> 4j) & 0x000F000F, two bf16 mantissas at once (int4_word_biased in
kernels/common.cuh, which leaves the +136 bias for the mma accumulator to remove). Every 16x16 mma step lies inside one k32 scale group, which is why the kernels
can scale the fp32 partial sums instead of the weights.

Gate and up are fused row-wise: fused tile f = gate rows 8f..8f+7 then up rows 8f..8f+7, so one
mma tile yields gate and up of the same intermediate index in one lane (SiLU(gate) * up in registers).

BF16 weights for the skinny GEMM (tile_bf16): W [N, K] -> [ceil(N/16), K/64, 4, 32, 8] bf16, rows
zero-padded to a multiple of 16; block j = 2 h + rh of lane (g, t) holds W[16 tile + 8 rh + g,
64 chunk + 32 h + 8 t .. +8], i.e. the same fragment order, 2 KB contiguous per (tile, chunk).
"""
from __future__ import annotations

import numpy as np

from ddtree.model.int4 import pack_int4, unpack_int4

GROUP = 32          # INT4 scale group of the kernel layout (the one definition: builder/plan.py and graphs use it)
# _NIBBLE[rh, j]: nibble position of (row half rh, column p + j) inside a word
_NIBBLE = np.array([[0, 4, 2, 6], [1, 5, 3, 7]], dtype=np.uint32)


def _check_matrix(name: str, q: np.ndarray, scale: np.ndarray) -> tuple[int, int]:
    if q.ndim != 2:
        raise ValueError(f"{name}: expected 2-D [N, K] weights, got shape {list(q.shape)}")
    n, k = q.shape
    if n % 32 or k % 64:
        raise ValueError(f"{name}: the MoE kernel layout needs N % 32 == 0 and K % 64 == 0, got [N, K] = [{n}, {k}]")
    if scale.dtype != np.uint16 or scale.shape != (n, k // GROUP):
        raise ValueError(f"{name}: expected bf16 (uint16) scales [{n}, {k // GROUP}], "
                         f"got {scale.dtype} {list(scale.shape)}")
    return n, k


def repack_q(q: np.ndarray, scale: np.ndarray, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """q [N, K] int8 in [-8, 7], scale [N, K/32] bf16 bits -> (words [N/32, K/64, 2, 32, 4] int32,
    scales [N/32, K/64, 2, 8, 4] uint16)."""
    n, k = _check_matrix(name, q, scale)
    u = (q.astype(np.int16) + 8).astype(np.uint32)
    # [tile, rh, g, chunk, h, t, u, j] with row = 16 tile + 8 rh + g and column = 64 chunk + 32 h + 8 t + 4 u + j
    u = u.reshape(n // 16, 2, 8, k // 64, 2, 4, 2, 4)
    u = u.transpose(0, 3, 2, 5, 4, 6, 1, 7)                      # [tile, chunk, g, t, h, u, rh, j]
    words = np.bitwise_or.reduce(u << (4 * _NIBBLE), axis=(-2, -1))   # [tile, chunk, g, t, h, u]
    words = words.reshape(n // 32, 2, k // 64, 32, 4).transpose(0, 2, 1, 3, 4).view(np.int32)
    s = scale.reshape(n // 32, 2, 2, 8, k // 64, 2)              # [pair, tile, rh, g, chunk, h]
    s = s.transpose(0, 4, 1, 3, 5, 2).reshape(n // 32, k // 64, 2, 8, 4)   # [pair, chunk, tile, g, 2 h + rh]
    return np.ascontiguousarray(words), np.ascontiguousarray(s)


def unpack_q(words: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of repack_q: -> (q [N, K] int8, scale [N, K/32] bf16 bits)."""
    if words.ndim != 5 or words.shape[2:] != (2, 32, 4) or words.dtype != np.int32:
        raise ValueError(f"unpack_q: expected int32 words [N/32, K/64, 2, 32, 4], got {words.dtype} {list(words.shape)}")
    pairs, kc = words.shape[:2]
    if scales.shape != (pairs, kc, 2, 8, 4) or scales.dtype != np.uint16:
        raise ValueError(f"unpack_q: expected uint16 scales [{pairs}, {kc}, 2, 8, 4], got {scales.dtype} "
                         f"{list(scales.shape)}")
    nt = 2 * pairs
    words = words.transpose(0, 2, 1, 3, 4).reshape(nt, kc, 32, 4)              # [tile, chunk, lane, word]
    scales = scales.transpose(0, 2, 1, 3, 4).reshape(nt, kc, 8, 4)             # [tile, chunk, g, 2 h + rh]
    w = words.view(np.uint32).reshape(nt, kc, 8, 4, 2, 2, 1, 1)  # [tile, chunk, g, t, h, u, rh, j]
    u = (w >> (4 * _NIBBLE)) & 0xF                              # [tile, chunk, g, t, h, u, 2, 4]
    u = u.transpose(0, 6, 2, 1, 4, 3, 5, 7).reshape(nt * 16, kc * 64)
    q = (u.astype(np.int16) - 8).astype(np.int8)
    s = scales.reshape(nt, kc, 8, 2, 2).transpose(0, 4, 2, 1, 3).reshape(nt * 16, kc * 2)
    return q, np.ascontiguousarray(s)


def tile_bf16(w: np.ndarray, name: str = "weight") -> np.ndarray:
    """Skinny-GEMM weight: W [N, K] bf16 bits -> [ceil(N/16), K/64, 4, 32, 8] uint16 (rows zero-padded)."""
    if w.ndim != 2 or w.dtype != np.uint16 or w.shape[1] % 64:
        raise ValueError(f"{name}: tile_bf16 needs a 2-D bf16 (uint16) [N, K] with K % 64 == 0, "
                         f"got {w.dtype} {list(w.shape)}")
    n, k = w.shape
    padded = np.zeros((-(-n // 16) * 16, k), dtype=np.uint16)
    padded[:n] = w
    t = padded.reshape(-1, 2, 8, k // 64, 2, 4, 8)              # [tile, rh, g, chunk, h, t, e]
    return np.ascontiguousarray(t.transpose(0, 3, 4, 1, 2, 5, 6).reshape(-1, k // 64, 4, 32, 8))


def untile_bf16(tiled: np.ndarray, n: int) -> np.ndarray:
    """Inverse of tile_bf16 (drops the padding rows)."""
    nt, kc = tiled.shape[:2]
    t = tiled.reshape(nt, kc, 2, 2, 8, 4, 8).transpose(0, 3, 4, 1, 2, 5, 6)   # [tile, rh, g, chunk, h, t, e]
    return np.ascontiguousarray(t.reshape(nt * 16, kc * 64)[:n])


def fuse_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gate, up [I, ...] -> fused [2I, ...]: per 8 rows, gate rows then up rows."""
    if gate.shape != up.shape or gate.shape[0] % 8:
        raise ValueError(f"fuse_gate_up: gate and up need equal shapes with rows % 8 == 0, "
                         f"got {list(gate.shape)} and {list(up.shape)}")
    i = gate.shape[0]
    both = np.stack([gate.reshape(i // 8, 8, *gate.shape[1:]), up.reshape(i // 8, 8, *up.shape[1:])], axis=1)
    return both.reshape(2 * i, *gate.shape[1:])


def split_gate_up(fused: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of fuse_gate_up."""
    i = fused.shape[0] // 2
    both = fused.reshape(i // 8, 2, 8, *fused.shape[1:])
    return both[:, 0].reshape(i, *fused.shape[1:]), both[:, 1].reshape(i, *fused.shape[1:])


def repack_expert(gate: tuple, up: tuple, down: tuple, name: str = "expert") -> dict[str, np.ndarray]:
    """One expert from the checkpoint's (weight_packed, weight_scale, weight_shape) triples ->
    {"gate_up": words, "gate_up_scale": scales, "down": words, "down_scale": scales}."""
    qg, sg = unpack_int4(gate[0], gate[2]), np.asarray(gate[1])
    qu, su = unpack_int4(up[0], up[2]), np.asarray(up[1])
    qd, sd = unpack_int4(down[0], down[2]), np.asarray(down[1])
    if qg.shape != qu.shape:
        raise ValueError(f"{name}: gate_proj {list(qg.shape)} and up_proj {list(qu.shape)} differ")
    if qd.shape != (qg.shape[1], qg.shape[0]):
        raise ValueError(f"{name}: down_proj {list(qd.shape)} is not the transpose of gate_proj {list(qg.shape)}")
    gu_words, gu_scale = repack_q(fuse_gate_up(qg, qu), fuse_gate_up(sg, su), f"{name}.gate_up")
    d_words, d_scale = repack_q(qd, sd, f"{name}.down_proj")
    return {"gate_up": gu_words, "gate_up_scale": gu_scale, "down": d_words, "down_scale": d_scale}


def unrepack_expert(packed: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Inverse of repack_expert -> {"gate"|"up"|"down": (weight_packed, weight_scale, weight_shape)}."""
    q_gu, s_gu = unpack_q(packed["gate_up"], packed["gate_up_scale"])
    qd, sd = unpack_q(packed["down"], packed["down_scale"])
    qg, qu = split_gate_up(q_gu)
    sg, su = split_gate_up(s_gu)
    out = {}
    for name, q, s in (("gate", qg, sg), ("up", qu, su), ("down", qd, sd)):
        out[name] = (pack_int4(q), np.ascontiguousarray(s), np.array(q.shape, dtype=np.int32))
    return out


def repack_experts(experts: list[tuple[tuple, tuple, tuple]], name: str = "experts") -> dict[str, np.ndarray]:
    """[(gate, up, down) triples per expert] -> stacked {"gate_up": [E, 2I/32, H/64, 2, 32, 4], ...}."""
    parts = [repack_expert(g, u, d, f"{name}.{e}") for e, (g, u, d) in enumerate(experts)]
    return {key: np.stack([p[key] for p in parts]) for key in parts[0]}
