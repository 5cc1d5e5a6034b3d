"""The routed experts' down projection + combine by output columns (kernels/moe_down_cols.cuh, issue 48): plan, and
the numpy twin of its schedule and combine. Host-only: every plan is checked against sm_90's and sm_120's shared
memory on the CPU (tests/plugins/test_moe_down_cols.py).

    p = plan_down_cols(shape, M, sm_count, smem_limit)      # ColsPlan, or ValueError naming what does not fit
    y = simulate_down_cols(act, ids, weights, packed, p)    # float64, the kernel's schedule

Block b owns `upb` tile pairs (32 upb output columns) of every tile of the launch; the launch's act rows [P, I]
(P = M topk) all sit in its shared memory, so the kernel serves few rows only (the plan says where it stops
fitting). Its output is bitwise moe_down's at one down k-split (the GPU test asserts it), so FusedMoE may take
either per M.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.plugins.moe_stream import STAGE_BYTES, align_tiles
from ddtree.plugins.reference import as_float, expert_dense

COLS_RINGS = ((2, 2), (3, 2), (4, 2), (2, 4))     # (slots, chunks per slot) compiled (DD_MOE_DOWN_COLS)
STATIC_SMEM = 64                                  # the kernel's static shared memory (s_mask), with margin

# Where FusedMoE takes this kernel instead of moe_down by default: (arch, hidden, inter per rank) -> (first M,
# last M, knobs). H100 (nvidia-h100-x1), Kimi tp 8 (7168, 256), one device call, `ddtree bench moe --tp 8
# --no-router --paths two-kernel,cols,stream --routing uniform|tree` (route kernel + experts, 16 routings a graph),
# us, moe_down -> moe_down_cols: uniform M = 1 28.2 -> 23.5 (the streaming launch 26.9), 5 68.1 -> 66.4, 9 96.7 ->
# 95.0, 13 127.9 -> 125.9, 17 157.8 -> 156.9; the rank-0 step in the same call (bench step --baseline): budget 8
# uniform / tree 0.5 1.012x / 1.033x, budget 16 1.014x / 1.023x (kernels/NOTES.md, "The down projection by output
# columns"). The plan's defaults (16 warps where they fit, else 8; 2 tile pairs a block; 3 x 2 rings) beat the
# variants swept (16 warps on 2 x 2 rings, 2 x 4 rings, 8 warps, 8 warps with one tile pair a block: 224 blocks).
COLS_MEASURED: dict = {("sm_90", 7168, 256): ((1, 17, {}),)}


@dataclass(frozen=True)
class ColsPlan:
    warps: int
    upb: int            # tile pairs (32 output columns each) a block
    ring: tuple         # (slots, chunks per slot) of each warp's cp.async ring
    blocks: int         # ceil(NP / upb)
    max_tiles: int      # the tile lists' bound the shared memory is sized for (MoEShape.max_tiles(M))
    smem: int

    @property
    def kernel(self) -> str:
        return "moe_down_cols_r%dc%d" % self.ring


def cols_smem(shape, M: int, warps: int, upb: int, ring: tuple) -> int:
    """Dynamic shared memory of one block (kernel order): rings, act rows (+ a zero row), bias corrections,
    y for the block's columns, the tile lists."""
    P, I = M * shape.topk, shape.inter
    rings = warps * ring[0] * ring[1] * STAGE_BYTES
    act = (P + 1) * (I + 32) * 2
    xc = P * (I // 32) * 4
    y = P * 32 * upb * 4
    tiles = shape.max_tiles(M) * 9 * 4
    return rings + act + xc + y + tiles


def plan_down_cols(shape, M: int, sm_count: int, smem_limit: int, warps: int | None = None, upb: int | None = None,
                   ring: tuple | None = None) -> ColsPlan:
    """The column-owner down launch at M rows. upb: the fewest tile pairs a block that keep the grid within one
    block an SM (224 tile pairs at hidden 7168: 2 on 132 or 188 SMs); warps: the most of 16, 8, 4 whose rings
    fit beside the act rows; ring: (3, 2) unless given. Raises ValueError naming the shared memory it needs."""
    H, I = shape.hidden, shape.inter
    if H % 32 or I % 64:
        raise ValueError(f"MoE down_cols: hidden {H} must be a multiple of 32 and inter {I} of 64")
    ring = tuple(ring or (3, 2))
    if ring not in COLS_RINGS:
        raise ValueError(f"MoE down_cols: ring {ring} is not compiled; choose from {COLS_RINGS}")
    if (I // 64) % ring[1]:
        raise ValueError(f"MoE down_cols: inter / 64 = {I // 64} chunks is not a multiple of the ring's {ring[1]}")
    NP = H // 32
    upb = upb or -(-NP // sm_count)
    if not 1 <= upb <= NP:
        raise ValueError(f"MoE down_cols: {upb} tile pairs a block outside [1, {NP}]")
    limit = smem_limit - STATIC_SMEM
    choices = [warps] if warps else [16, 8, 4]
    for w in choices:
        if w * 32 > 512 or w < 1:
            raise ValueError(f"MoE down_cols: {w} warps a block (1..16)")
        smem = cols_smem(shape, M, w, upb, ring)
        if smem <= limit:
            return ColsPlan(w, upb, ring, -(-NP // upb), shape.max_tiles(M), smem)
    need = cols_smem(shape, M, choices[-1], upb, ring)
    raise ValueError(f"MoE down_cols: M = {M} ({M * shape.topk} act rows of {I}) needs {need} B of shared memory "
                     f"at {choices[-1]} warps, ring {ring}, {upb} tile pairs a block; the device allows {limit}")


def cols_default(arch: str, shape, M: int) -> dict | None:
    """The measured knobs where this kernel is FusedMoE's default at M on `arch`, else None."""
    for first, last, knobs in COLS_MEASURED.get((arch.rstrip("a"), shape.hidden, shape.inter), ()):
        if first <= M <= last:
            return dict(knobs)
    return None


def cols_items(tiles: int, NP: int, plan: ColsPlan) -> list[list[list[tuple]]]:
    """The kernel's schedule: [block][warp] -> (tile, tile pair) items in the order the warp takes them."""
    out = []
    for b in range(plan.blocks):
        pair0 = b * plan.upb
        my_upb = min(plan.upb, NP - pair0)
        n = tiles * my_upb
        out.append([[(i // my_upb, pair0 + i % my_upb) for i in range(w, n, plan.warps)]
                    for w in range(plan.warps)])
    return out


def simulate_down_cols(act: np.ndarray, ids: np.ndarray, weights: np.ndarray, packed: dict, plan: ColsPlan,
                       shared: np.ndarray | None = None) -> np.ndarray:
    """Numpy twin of moe_down_cols (float64): each warp's items on exactly their 32 columns of one tile's pairs into
    the block's y, then the block's combine of its columns. Checks what the kernel relies on: every y element of a
    block is written exactly once before its combine reads it, every output element is written by one block.
    act [P, I] (moe_gate_up's rows, P = M topk), ids / weights [M, topk], packed: kernel-layout experts -> [M, H]."""
    M, topk = ids.shape
    act = as_float(act, np.float64)
    tile_expert, tile_pairs = align_tiles(ids)
    down = {}
    H = packed["down"].shape[1] * 32
    NP = H // 32
    out = np.full((M, H), np.nan)
    for b, warps in enumerate(cols_items(len(tile_expert), NP, plan)):
        cols = slice(32 * b * plan.upb, min(H, 32 * (b + 1) * plan.upb))
        y = np.full((M * topk, cols.stop - cols.start), np.nan)          # the block's y_s
        for items in warps:
            for z, pair in items:
                e = tile_expert[z]
                if e not in down:
                    down[e] = expert_dense(packed["down"][e], packed["down_scale"][e])    # [H, I]
                pairs = tile_pairs[z][tile_pairs[z] >= 0]
                n = slice(32 * pair - cols.start, 32 * pair + 32 - cols.start)
                assert np.isnan(y[pairs, n]).all(), f"block {b}: y of tile {z}, pair {pair} written twice"
                y[pairs, n] = act[pairs] @ down[e][32 * pair:32 * pair + 32].T
        assert not np.isnan(y).any(), f"block {b}: a y element its combine reads was never written"
        assert np.isnan(out[:, cols]).all(), f"block {b}: output columns {cols} written twice"
        out[:, cols] = np.einsum("mk,mkn->mn", weights.astype(np.float64), y.reshape(M, topk, -1))
        if shared is not None:
            out[:, cols] += as_float(shared, np.float64)[:M, cols]
    assert not np.isnan(out).any(), "an output element was never written"
    return out
