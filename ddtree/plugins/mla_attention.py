"""Launcher for the tree-masked absorbed MLA attention and its split plan (two kernel forms, one contract).

    attn = MlaTreeAttention(gpu, heads=8, scale=cfg.softmax_scale, latent=cfg.kv_lora_rank,
                            rope=cfg.qk_rope_head_dim, max_q=256, max_context=131072)
    attn.run(q_lat, q_rope, cache_layer, vis, lengths, q, out, lse=None, context_hint=T)

With latent DL and rope DR (Kimi: 512 / 64; the kernels compile for them, compile.latent_defines):
q_lat [q, H, DL] bf16, q_rope [q, H, DR] bf16, cache one layer [>= T + q, DL + DR] bf16 with the q tree
entries already appended at T .., vis [q, ceil(q/32)] uint32 (docs/interfaces.md section 4), lengths a device
int32 [1] holding T. out [q, H, DL] bf16; lse [q, H] fp32 (natural log) when given. Numpy twin:
ddtree.plugins.reference.mla_tree_attention.

Forms: "decode" (kernels/mla_decode.cu) while q * H <= 32, bandwidth-bound: keys are the mma M, 8 query
rows the N, all rows in one block so every key is read once; "tree" (kernels/mla_attention.cu) beyond,
compute-bound: warp pairs share 16 query rows ("tree_qreg", kernels/mla_tree_qreg.cuh: 2 or 4 warps share 16
rows and hold their query fragments in registers; the default where measured faster, qreg_default; "tree_wgmma",
kernels/mla_tree_wgmma.cuh: 64 rows and two warpgroups a block on sm_90a's wgmma, the default on an sm_90 GPU where
measured faster, wgmma_default). All split
the committed prefix over the SMs, give the tree keys (the only masked ones) their own split or the end of
the last one, and merge splits exactly by log-sum-exp (mla_attention_combine). The plan (form, block shape, ring
depth, number of prefix splits P) depends on q, H and the context: decode by a wave model of the splits, tree up
to TREE_FIT_ROWS rows by a cost model fitted to an H200 sweep (tree_cost). T itself is read on the device, so a
graph captured with the plan for a context bucket runs at any T in it (the chunk per split is ceil(T / P),
rounded up to the block's keys). Workspaces are sized in the constructor for (max_q, max_context); run() only
launches.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ddtree.plugins.compile import latent_defines
from ddtree.plugins.device import DeviceArray, Gpu, ptr
from ddtree.plugins.gemm import supports_pdl

SOURCE, DECODE_SOURCE = "mla_attention.cu", "mla_decode.cu"
PROB_STRIDE, DECODE_PROB_STRIDE = 40, 24      # MLA_PROW, DEC_PROW in the kernels
# (form, warps, stages, row groups) compiled; a block serves 8 x row groups query rows.
# "tree": mla_attention.cu, warp pairs share 16 query rows (row groups = warps), a ring of `stages` 32-key
# blocks. "decode": mla_decode.cu, row groups of 8 rows x warps / row groups key streams of 16-key
# sub-blocks, a ring of `stages` 16-key slots.
# "tree_qreg": kernels/mla_tree_qreg.cuh (issue 23; default only by qreg_default), groups of warps / (row groups / 2)
# warps share 16 query rows and hold their query fragments in registers; 4-warp groups need latent % 64 == 0.
QREG_VARIANTS = (("tree_qreg", 2, 2, 2), ("tree_qreg", 2, 3, 2), ("tree_qreg", 4, 2, 4), ("tree_qreg", 4, 3, 4),
                 ("tree_qreg", 4, 2, 2), ("tree_qreg", 4, 3, 2), ("tree_qreg", 8, 2, 4))
# "tree_wgmma": kernels/mla_tree_wgmma.cuh (issue 23; sm_90a only; the default only by wgmma_default), 64
# query rows (8 row groups) and two warpgroups (8 warps) a block, key blocks of WGMMA_KEYS[stages] keys.
WGMMA_VARIANTS = (("tree_wgmma", 8, 2, 8),)
WGMMA_KEYS = {2: 64}                    # keys a block per ring depth (mla_attention_wgmma_k<keys>_s<stages>)
WGMMA_ARCH = "sm_90a"                   # wgmma exists on sm_90a alone (not sm_120)
# tree_wgmma is the default on an sm_90 GPU only where it measured faster (H200, 8 heads, swizzled tiles, against
# the default plans then; tests/fixtures/plugins/attention_wgmma_sweep*_h200.jsonl), with one wave of blocks
# (prefix splits ceil(SMs / row tiles) - 1, the tree split its own; fewer splits were slower everywhere):
#   3 row tiles (129..192 rows: 17 tokens): 32768 keys 66.9 -> 57.5 us, 131072 241.4 -> 185.6; at 4096 slower
#     (18.5 vs 17.6), so from 32768 keys;
#   5 and 9 row tiles (33, 65 tokens): 4096 keys 28.1 -> 24.1, 41.6 -> 30.6; 32768 117.3 -> 86.2, 238.1 -> 146.1;
#   131072 421.5 -> 296.5, 831.5 -> 526.1.
# Tiles 4 (193..256 rows, not measured) follow the 3-tile rule, 6..8 the 5 / 9-tile one; contexts between the measured
# ones are taken (it won at both ends), up to 131072 + MAX_Q (the step plans for T + q); 8 tokens (64 rows) stay on
# tree_qreg (16.4 vs 12.5 us at 4096, 37.7 vs 36.7 at 32768).
WGMMA_DEFAULT_CONTEXTS = {3: (32768, 131072 + 256), 4: (32768, 131072 + 256), 5: (4096, 131072 + 256),
                          6: (4096, 131072 + 256), 7: (4096, 131072 + 256), 8: (4096, 131072 + 256),
                          9: (4096, 131072 + 256)}      # 64-row tiles -> keys
VARIANTS = (("tree", 2, 2, 2), ("tree", 2, 3, 2), ("tree", 2, 4, 2), ("tree", 4, 2, 4), ("tree", 4, 3, 4),
            ("tree", 8, 2, 8), ("tree", 8, 3, 8), ("decode", 2, 4, 1), ("decode", 3, 9, 1), ("decode", 4, 8, 1),
            ("decode", 4, 4, 2), ("decode", 6, 9, 2), ("decode", 8, 8, 4), ("decode", 8, 7, 8)) + QREG_VARIANTS + WGMMA_VARIANTS
QREG_DEFINES = {"MLA_TREE_QREG": 1}  # the tree_qreg kernels' cubin (mla_attention.cu without its other variants)
WGMMA_DEFINES = {"MLA_TREE_WGMMA": 1}  # the tree_wgmma kernels' cubin (for WGMMA_ARCH)
TREE_FORMS = ("tree", "tree_qreg", "tree_wgmma")
MIN_CHUNK = 64                     # keys per prefix split at least
# q * H up to DECODE_MAX_ROWS rows take the decode form (H200, 64 rows: the tree form's 2 x 4-warp blocks per
# SM beat the one-stream 8-row-group decode block 1.2x at 32768 keys and 1.5x at 131072)
DECODE_MAX_ROWS = 32
MAX_Q, MAX_HEADS = 256, 128
# Tree plans up to TREE_FIT_ROWS rows minimise tree_cost, a least-squares fit (relative error) of 135 swept
# plans on the H200 (T 4096 .. 131072, 64 .. 264 rows at 8 heads, every tree variant at 0.5 / 1 / 2 x the wave
# model's splits; tests/fixtures/plugins/attention_sweep_h200.json; rms error 6.7 %, worst 42 % on 3-wave
# plans): us per 32-key step of one block by (warps, blocks sharing its SM), us per call, per wave of
# blocks, and per partial row (a split's fp32 [latent] output, written, then read by the combine)
TREE_FIT_ROWS = 264
TREE_STEP_US = {(2, 1): 1.652, (2, 2): 1.963, (4, 1): 1.895, (4, 2): 2.723, (8, 1): 2.896}
TREE_CALL_US, TREE_WAVE_US, TREE_PARTIAL_ROW_US = 5.02, 0.72, 1.265e-3
# tree_qreg is the default only where it measured faster (H200, one call, 8 heads, default vs forced, the fitted
# splits): 4-warp groups (w4 g2) at 4096 keys: 8 tokens 14.47 -> 12.45 us, 17 tokens 19.99 -> 17.55; two 2-warp
# groups (w4 g4) at 32768: 39.83 -> 36.24, 75.18 -> 66.22. Rows 64 .. 136, contexts 4096 .. 32768, a device with
# the H200's 227 KB per block (sm_120's 99 KB: not measured), latents with both group sizes compiled.
QREG_DEFAULT_ROWS, QREG_DEFAULT_CONTEXTS, QREG_DEFAULT_MIN_SMEM = (64, 136), (4096, 32768), 232448


def row_stride(latent: int, rope: int) -> int:
    """MLA_ROW: the shared-memory row of a key or query in bf16, latent + rope + 8 (an odd number of 16-byte
    chunks when latent + rope is a multiple of 16: conflict-free ldmatrix; Kimi 584)."""
    return latent + rope + 8


def qreg_group(warps: int, row_groups: int) -> int:
    """Warps sharing 16 query rows in a tree_qreg block (G of MlaQregSmem<NGRP, G, STAGES>)."""
    return warps // (row_groups // 2)


def compiled_at(form: str, warps: int, stages: int, row_groups: int, latent: int, rope: int = 64) -> bool:
    """Whether the variant exists at this latent (tree_qreg 4-warp groups: latent / 4 in 16-dim P.V steps;
    tree_wgmma: latent 512, one m64n256 P.V wgmma a warpgroup)."""
    if form == "tree_wgmma":                         # and a warp copies 4 of a row's 16-byte chunks a step
        return latent == 512 and (latent + rope) % 32 == 0
    return form != "tree_qreg" or qreg_group(warps, row_groups) == 2 or latent % 64 == 0


def smem_bytes(form: str, warps: int, stages: int, row_groups: int, latent: int, rope: int) -> int:
    """sizeof(MlaSmem<warps / 2, stages>), sizeof(MlaQregSmem<row_groups / 2, G, stages>) or
    sizeof(DecodeSmem<row_groups, warps / row_groups, stages>) when compiled for (latent, rope)."""
    row = row_stride(latent, rope)
    if form == "tree_wgmma":                         # WgSmem<keys, stages>: queries, ring, P tile, row swaps
        keys, dk = WGMMA_KEYS[stages], latent + rope
        return 64 * dk * 2 + stages * keys * dk * 2 + 64 * keys * 2 + 2 * 64 * 4 + 1024   # + 1024-B alignment
    if form == "tree_qreg":                          # no query tile: the rows borrow a ring slot; partial scores
        groups = row_groups // 2                     # [16, 32 + 8] fp32 per warp
        return (stages * 32 * row * 2 + groups * 16 * PROB_STRIDE * 2 + warps * 16 * 40 * 4 + warps * 16 * 4
                + 8 * stages)
    if form == "tree":
        pairs = warps // 2
        return (pairs * 16 * row * 2 + stages * 32 * row * 2
                + pairs * 16 * PROB_STRIDE * 2 + pairs * 2 * 16 * 4 + 8 * stages)
    ring = stages * 16 * row * 2
    merge = warps * 8 * (latent + 4) * 4 + 2 * warps * 8 * 4          # fp32 rows padded by 4 (DEC_OROW)
    return (row_groups * 8 * row * 2 + max(ring, merge) + warps * 8 * DECODE_PROB_STRIDE * 2
            + 2 * 8 * stages)


def combine_shape(splits: int, latent: int, rows: int, sm_count: int) -> tuple[int, int]:
    """(split groups, lanes) of mla_attention_combine's 256 threads (grid rows x latent / (4 lanes)): lanes of
    4-dim columns as wide as latent / 4 allows (a power of two dividing it, <= 128), halved (groups doubled)
    while the grid would not give every SM a block and the groups do not yet cover the splits (power of two),
    down to 8 lanes. H200: 136 rows x 26 splits took 7.4 us as 1088 blocks of 16 x 16 (over one wave at 64
    registers) where one block per row covers the row."""
    top = 8
    while top < 128 and (latent // 4) % (2 * top) == 0:
        top *= 2
    lanes = top
    while lanes > 8 and rows * (latent // (4 * lanes)) < sm_count and 256 // lanes < 1 << (splits - 1).bit_length():
        lanes //= 2
    return 256 // lanes, lanes


@dataclass(frozen=True)
class AttentionPlan:
    form: str          # "tree" or "decode"
    warps: int         # warps per block
    stages: int        # key-ring depth
    row_groups: int    # 8-row groups per block
    row_tiles: int     # blocks along the query rows
    prefix_splits: int # P: equal chunks of the committed prefix
    tree_own: bool     # the tree keys get their own split (else they end the last prefix split)
    smem: int

    @property
    def splits(self) -> int:
        return self.prefix_splits + int(self.tree_own)

    @property
    def rows_per_block(self) -> int:
        return 8 * self.row_groups

    @property
    def source(self) -> str:
        return SOURCE if self.form in TREE_FORMS else DECODE_SOURCE

    @property
    def extra_defines(self) -> dict[str, int]:
        return QREG_DEFINES if self.form == "tree_qreg" else WGMMA_DEFINES if self.form == "tree_wgmma" else {}

    @property
    def arch(self) -> str | None:
        """The arch the kernel compiles for when not the device's own (tree_wgmma: sm_90a)."""
        return WGMMA_ARCH if self.form == "tree_wgmma" else None

    @property
    def kernel(self) -> str:
        if self.form == "tree":
            return f"mla_attention_p{self.warps // 2}_s{self.stages}"
        if self.form == "tree_wgmma":
            return f"mla_attention_wgmma_k{WGMMA_KEYS[self.stages]}_s{self.stages}"
        if self.form == "tree_qreg":
            g = qreg_group(self.warps, self.row_groups)
            return f"mla_attention_qreg_r{self.warps // g}_w{g}_s{self.stages}"
        return f"mla_decode_r{self.row_groups}_k{self.warps // self.row_groups}_s{self.stages}"


def blocks_per_sm(smem: int, smem_limit: int) -> int:
    """Resident blocks per SM by shared memory (the per-block opt-in limit is the SM's capacity less 1 KB
    reserved per block), at most 2."""
    return max(1, min(2, (smem_limit + 1024) // (smem + 1024)))


def tree_cost(warps: int, stages: int, row_groups: int, splits: int, context: int, q: int, rows: int,
              sm_count: int, smem_limit: int, latent: int, rope: int, form: str = "tree") -> float:
    """Modelled us of a tree-form plan with `splits` prefix splits (the tree keys get their own from 2 on):
    TREE_CALL_US + waves x (TREE_WAVE_US + steps per block x step us) + partial rows x TREE_PARTIAL_ROW_US.
    A block's step slows when another block shares its SM (2 x 4 warps: 1.44x, 2 x 2 warps: 1.19x); sharing
    not measured is priced as fully serial. form "tree_qreg" is priced as "tree" at its own shared memory
    (not fitted: it only orders the forced tree_qreg plans)."""
    per_sm = blocks_per_sm(smem_bytes(form, warps, stages, row_groups, latent, rope), smem_limit)
    own = int(splits >= 2)
    blocks = math.ceil(rows / (8 * row_groups)) * (splits + own)
    sharing = min(per_sm, math.ceil(blocks / sm_count))
    waves = math.ceil(blocks / (sm_count * per_sm))
    chunk = math.ceil(math.ceil(context / splits) / 32) * 32
    steps = math.ceil(min(chunk, context) / 32) + (0 if own else math.ceil(q / 32))
    step_us = TREE_STEP_US.get((warps, sharing)) or sharing * TREE_STEP_US[(warps, 1)]
    partial_rows = (splits + own) * rows if splits + own > 1 else 0
    return TREE_CALL_US + waves * (TREE_WAVE_US + steps * step_us) + TREE_PARTIAL_ROW_US * partial_rows


def qreg_default(rows: int, context: int, smem_limit: int, latent: int) -> tuple[int, int] | None:
    """(warps, row groups) of the default tree_qreg plan where it measured faster than the tree form, else None:
    4-warp groups up to 4096 keys, two 2-warp groups past it."""
    if not (QREG_DEFAULT_ROWS[0] <= rows <= QREG_DEFAULT_ROWS[1]
            and QREG_DEFAULT_CONTEXTS[0] <= context <= QREG_DEFAULT_CONTEXTS[1]
            and smem_limit >= QREG_DEFAULT_MIN_SMEM and latent % 64 == 0):
        return None
    return (4, 2) if context <= 4096 else (4, 4)


def wgmma_default(rows: int, context: int, latent: int, rope: int, sm_count: int) -> int | None:
    """Prefix splits of the default tree_wgmma plan where it measured faster than the other forms (on an sm_90
    GPU: the caller checks the arch), else None."""
    tiles = math.ceil(rows / 64)
    lo, hi = WGMMA_DEFAULT_CONTEXTS.get(tiles, (1, 0))
    if lo <= context <= hi and compiled_at(*WGMMA_VARIANTS[0], latent, rope):
        return max(1, math.ceil(sm_count / tiles) - 1)
    return None


def fitted_tree_plan(fits, q: int, rows: int, context: int, sm_count: int, smem_limit: int, latent: int, rope: int,
                     warps, stages, row_groups, splits, form: str = "tree") -> tuple[int, int, int, int] | None:
    """(warps, stages, row groups, splits) of least tree_cost among the compiled variants that fit and match
    the forced knobs (None where none does); splits from 1 to two waves of blocks, chunks >= MIN_CHUNK keys."""
    best = None
    for w, s, g in fits:
        if any(f is not None and f != v for f, v in ((warps, w), (stages, s), (row_groups, g))):
            continue
        tiles = math.ceil(rows / (8 * g))
        capacity = sm_count * blocks_per_sm(smem_bytes(form, w, s, g, latent, rope), smem_limit)
        top = max(1, min(math.ceil(context / MIN_CHUNK), 2 * capacity // tiles))
        for P in [splits] if splits is not None else range(1, top + 1):
            cost = tree_cost(w, s, g, P, context, q, rows, sm_count, smem_limit, latent, rope, form)
            best = min(best or (cost, -s, w, g, P), (cost, -s, w, g, P))        # ties: the deeper ring
    return (best[2], -best[1], best[3], best[4]) if best else None


@functools.lru_cache(maxsize=4096)
def plan_attention(q: int, heads: int, context: int, sm_count: int, smem_limit: int, *, latent: int, rope: int,
                   form: str | None = None, warps: int | None = None, stages: int | None = None,
                   splits: int | None = None, row_groups: int | None = None) -> AttentionPlan:
    """Form: decode while q * H <= DECODE_MAX_ROWS (bandwidth-bound: all rows in one block, so the keys are
    read once), else tree_qreg where qreg_default says it measured faster, else tree. Tree up to TREE_FIT_ROWS
    rows: the variant and prefix splits of least tree_cost.
    Otherwise block rows by q * H (decode: all of them up to 64; tree: 64 rows), the most warps, the ring
    that keeps the most blocks resident (tree) or the deepest (decode), and choose_splits' wave model with
    chunks of at least MIN_CHUNK keys. `form`, `warps`, `stages`, `splits`, `row_groups` force a choice
    (benchmark sweeps). Shared memory is sized for the model's (latent, rope); dims the kernels cannot take
    raise LatentDimsError."""
    latent_defines(latent, rope)
    if not 1 <= q <= MAX_Q:
        raise ValueError(f"MLA tree attention: q = {q} new tokens outside [1, {MAX_Q}]")
    if not 1 <= heads <= MAX_HEADS:
        raise ValueError(f"MLA tree attention: heads = {heads} outside [1, {MAX_HEADS}]")
    if context < 0:
        raise ValueError(f"MLA tree attention: context = {context} must be >= 0")
    rows = q * heads
    qreg = qreg_default(rows, context, smem_limit, latent)
    if form is None and qreg and warps is stages is splits is row_groups is None:
        form, (warps, row_groups) = "tree_qreg", qreg
    if form is None:
        form = "decode" if rows <= DECODE_MAX_ROWS else "tree"
    fits = [v[1:] for v in VARIANTS if v[0] == form and smem_bytes(*v, latent, rope) <= smem_limit
            and compiled_at(*v, latent, rope)]
    if not fits:
        raise ValueError(f"MLA tree attention: no compiled {form!r} variant fits {smem_limit} B of shared memory "
                         f"at latent {latent}, rope {rope}")
    fitted = None
    if form in TREE_FORMS and rows <= TREE_FIT_ROWS:
        fitted = fitted_tree_plan(fits, q, rows, context, sm_count, smem_limit, latent, rope, warps, stages,
                                  row_groups, splits, form)
    if fitted:
        warps, stages, row_groups, splits = fitted
    if row_groups is None:
        want = -(-rows // 8) if form == "decode" else 8 if form == "tree" else 4
        groups = sorted({g for w, _, g in fits if warps is None or w == warps})
        if not groups:
            raise ValueError(f"MLA tree attention: no compiled {form!r} variant of {warps} warps fits {smem_limit} B "
                             f"of shared memory at latent {latent}, rope {rope}")
        row_groups = next((g for g in groups if g >= want), groups[-1])
    if warps is None:
        warps = max(w for w, _, g in fits if g == row_groups)
    if stages is None:
        rings = [s for w, s, g in fits if w == warps and g == row_groups] or [0]
        resident = (lambda s: blocks_per_sm(smem_bytes(form, warps, s, row_groups, latent, rope), smem_limit)) \
            if form in TREE_FORMS else (lambda s: 1)
        stages = max(rings, key=lambda s: (resident(s), s))
    if (form, warps, stages, row_groups) not in VARIANTS or not compiled_at(form, warps, stages, row_groups, latent, rope):
        raise ValueError(f"MLA tree attention: (form, warps, stages, row groups) = ({form!r}, {warps}, {stages}, "
                         f"{row_groups}) not compiled; have {VARIANTS}")
    smem = smem_bytes(form, warps, stages, row_groups, latent, rope)
    if smem > smem_limit:
        raise ValueError(f"MLA tree attention: {form} with {warps} warps x {stages} stages needs {smem} B of shared "
                         f"memory; the device allows {smem_limit}")
    row_tiles = math.ceil(rows / (8 * row_groups))
    capacity = sm_count * blocks_per_sm(smem, smem_limit)
    if splits is None:
        splits, tree_own = choose_splits(context, q, row_tiles, capacity)
    else:
        tree_own = splits >= 2
    if splits < 1:
        raise ValueError(f"MLA tree attention: splits must be >= 1, got {splits}")
    return AttentionPlan(form, warps, stages, row_groups, row_tiles, splits, tree_own, smem)


def choose_splits(context: int, q: int, row_tiles: int, capacity: int, fixed: int = 256) -> tuple[int, bool]:
    """(prefix splits P, tree_own) minimising a wave model of the latency, in keys: each prefix block costs
    its chunk + `fixed` (prologue, epilogue, merge: ~8 us on the H200, about 256 keys' streaming), each tree
    block q + fixed; blocks run in waves of `capacity`, and the light tree blocks fill a wave's spare slots
    first. With one split the tree rides at the end of it (no combine). H200: a decode split that left the
    tree block a second wave of its own cost 1-2 us (P = 132 vs 131 at T = 32768); one-wave splits starved
    compute-bound shapes (64 heavy blocks on 132 SMs: 1.8x slower than 128 heavy + 64 light)."""
    best = (math.ceil(row_tiles / capacity) * (context + q + fixed), 1, False)      # one merged split
    for P in range(2, min(math.ceil(context / MIN_CHUNK), 4 * capacity) + 1):
        heavy = row_tiles * P
        waves = math.ceil(heavy / capacity)
        spare = waves * capacity - heavy
        cost = waves * (math.ceil(context / P) + fixed)
        if row_tiles > spare:
            cost += math.ceil((row_tiles - spare) / capacity) * (q + fixed)
        best = min(best, (cost, P, True))
    return best[1], best[2]


class MlaTreeAttention:
    """Tree-masked absorbed MLA for `heads` heads and up to max_q new tokens over up to max_context keys,
    compiled for the model's latent (kv_lora_rank) and rope (qk_rope_head_dim) dims."""

    def __init__(self, gpu: Gpu, heads: int, scale: float, *, latent: int, rope: int, max_q: int = MAX_Q,
                 max_context: int = 131072, pdl: bool = True):
        """scale: the softmax scale of the model (KimiConfig.softmax_scale: 192^-1/2 times the YaRN mscale^2)."""
        self.gpu, self.heads, self.scale, self.max_q, self.max_context = gpu, heads, float(scale), max_q, max_context
        self.defines = latent_defines(latent, rope)          # LatentDimsError before anything compiles
        self.latent, self.rope = latent, rope
        self.pdl = pdl and supports_pdl(gpu)
        plan_attention(max_q, heads, max_context, gpu.sm_count, gpu.smem_optin, latent=latent, rope=rope)
        self._overrides: dict[tuple[int, int], AttentionPlan] = {}
        self._part_rows = 0
        # splits grow with the context, so the plans at max_context bound the partial rows of each form; the
        # tree_wgmma plans hold their splits over their context ranges, so the ranges' ends count too
        contexts = {max_context} | {min(max_context, c) for r in WGMMA_DEFAULT_CONTEXTS.values() for c in r}
        self._reserve_partials(max([1] + [p.splits * q * heads for q in range(1, max_q + 1) for c in contexts
                                          for p in [self.plan(q, c)] if p.splits > 1]))

    def plan(self, q: int, context: int) -> AttentionPlan:
        key = (q, context)
        if key in self._overrides:
            return self._overrides[key]
        splits = (wgmma_default(q * self.heads, context, self.latent, self.rope, self.gpu.sm_count)
                  if self.gpu.arch == "sm_90" else None)
        if splits is not None and smem_bytes(*WGMMA_VARIANTS[0], self.latent, self.rope) <= self.gpu.smem_optin:
            _, warps, stages, row_groups = WGMMA_VARIANTS[0]
            return plan_attention(q, self.heads, context, self.gpu.sm_count, self.gpu.smem_optin, latent=self.latent,
                                  rope=self.rope, form="tree_wgmma", warps=warps, stages=stages, row_groups=row_groups,
                                  splits=splits)
        return plan_attention(q, self.heads, context, self.gpu.sm_count, self.gpu.smem_optin,
                              latent=self.latent, rope=self.rope)

    def override(self, q: int, context: int, **forced) -> AttentionPlan:
        """Benchmark sweeps: force form / warps / stages / splits / row_groups for (q, context); grows the
        workspace if needed."""
        if forced.get("form") == "tree_wgmma" and self.gpu.arch != "sm_90":
            raise ValueError(f"MLA tree attention: form tree_wgmma needs an sm_90 GPU (wgmma, compiled for "
                             f"{WGMMA_ARCH}); {self.gpu.name} is {self.gpu.arch}")
        p = plan_attention(q, self.heads, context, self.gpu.sm_count, self.gpu.smem_optin, latent=self.latent,
                           rope=self.rope, **forced)
        if p.splits > 1:
            self._reserve_partials(p.splits * q * self.heads)
        self._overrides[(q, context)] = p
        return p

    def _reserve_partials(self, rows: int) -> None:
        """Split partials for `rows` (split, query row) pairs: [rows, latent] outputs and [rows] log2-sum-exps."""
        if rows > self._part_rows:
            self.part_o = self.gpu.alloc(rows * self.latent, np.float32)
            self.part_lse = self.gpu.alloc(rows, np.float32)
            self._part_rows = rows

    def run(self, q_lat: DeviceArray | int, q_rope: DeviceArray | int, cache: DeviceArray | int,
            vis: DeviceArray | int, lengths: DeviceArray | int, q: int, out: DeviceArray | int,
            lse: DeviceArray | int | None = None, context_hint: int | None = None, stream=None) -> AttentionPlan:
        """Launch (no host sync). context_hint picks the plan (default max_context); T comes from lengths."""
        p = self.checked_plan(q, context_hint)
        self.launch_splits(p, q_lat, q_rope, cache, vis, lengths, q, out, lse, stream)
        if p.splits > 1:
            self.launch_combine(p, q, out, lse, stream)
        return p

    def checked_plan(self, q: int, context_hint: int | None = None) -> AttentionPlan:
        """The plan run() launches for q tokens at context_hint (default max_context), checked against the
        workspace."""
        if not 1 <= q <= self.max_q:
            raise ValueError(f"MLA tree attention: q = {q} outside [1, {self.max_q}]")
        context = self.max_context if context_hint is None else context_hint
        if not 0 <= context <= self.max_context:
            raise ValueError(f"MLA tree attention: context_hint {context} outside [0, {self.max_context}]")
        p = self.plan(q, context)
        if p.splits > 1 and p.splits * q * self.heads > self._part_rows:
            raise ValueError(f"MLA tree attention: plan {p} needs {p.splits * q * self.heads} partial rows; "
                             f"the workspace has {self._part_rows}")
        return p

    def launch_splits(self, p: AttentionPlan, q_lat, q_rope, cache, vis, lengths, q: int, out, lse=None,
                      stream=None) -> None:
        """The split kernel alone: out / lse when p has one split, else the partials for launch_combine."""
        scale_log2 = np.float32(self.scale * math.log2(math.e))
        defines = {**self.defines, **p.extra_defines}
        self.gpu.allow_smem(p.source, p.kernel, p.smem, defines, arch=p.arch)
        self.gpu.launch(self.gpu.kernel(p.source, p.kernel, defines, arch=p.arch), (p.row_tiles, p.splits), p.warps * 32,
                        p.smem, ptr(q_lat), ptr(q_rope), ptr(cache), ptr(vis), ptr(lengths), ptr(out), ptr(lse),
                        ptr(self.part_o), ptr(self.part_lse), np.int32(q * self.heads), np.int32(self.heads),
                        np.int32(q), np.int32(p.prefix_splits), np.int32(int(p.tree_own)), scale_log2,
                        stream=stream, pdl=self.pdl)

    def launch_combine(self, p: AttentionPlan, q: int, out, lse=None, stream=None) -> None:
        """mla_attention_combine alone: merges the partials of p's splits into out / lse."""
        rows = q * self.heads
        _, lanes = combine_shape(p.splits, self.latent, rows, self.gpu.sm_count)   # groups x lanes = 256 threads
        self.gpu.launch(self.gpu.kernel(SOURCE, "mla_attention_combine", self.defines),
                        (rows, self.latent // (4 * lanes)), 256, 256 * 16 + 4 * p.splits,
                        ptr(self.part_o), ptr(self.part_lse), ptr(out), ptr(lse),
                        np.int32(rows), np.int32(p.splits), np.int32(lanes), stream=stream, pdl=self.pdl)
