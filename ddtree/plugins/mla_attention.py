"""Launcher for the tree-masked absorbed MLA attention (kernels/mla_attention.cu) and its split plan.

    attn = MlaTreeAttention(gpu, heads=8, scale=cfg.softmax_scale, max_q=256, max_context=131072)
    attn.run(q_lat, q_rope, cache_layer, vis, lengths, q, out, lse=None, context_hint=T)

q_lat [q, H, 512] bf16, q_rope [q, H, 64] bf16, cache one layer [>= T + q, 576] bf16 with the q tree
entries already appended at T .., vis [q, ceil(q/32)] uint32 (interfaces.md section 4), lengths a device
int32 [1] holding T. out [q, H, 512] bf16; lse [q, H] fp32 (natural log) when given.

The plan (rows per block, ring depth, number of prefix splits P, whether the tree keys get their own
split) depends on q, H and the context; T itself is read on the device, so a graph captured with the
plan for a context bucket runs at any T in it (the chunk per split is ceil(T / P), rounded up to 32).
Workspaces are sized in the constructor for (max_q, max_context); run() only launches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddtree.plugins.device import DeviceArray, Gpu, ptr
from ddtree.plugins.gemm import supports_pdl

SOURCE = "mla_attention.cu"
LATENT, ROPE, KEY_DIM = 512, 64, 576
KEYS_PER_BLOCK, ROW_STRIDE, PROB_STRIDE = 32, 584, 40     # MLA_NB, MLA_ROW, MLA_PROW in the kernel
VARIANTS = ((1, 2), (1, 3), (1, 4), (2, 2), (2, 3), (4, 2), (4, 3))   # (pairs, stages) compiled
MIN_CHUNK = 256                    # keys per prefix split at least (8 blocks: the ring's ramp amortised)
MAX_Q, MAX_HEADS = 256, 128


def smem_bytes(pairs: int, stages: int) -> int:
    """sizeof(MlaSmem<pairs, stages>): query rows, key ring, probabilities, row swap."""
    return (pairs * 16 * ROW_STRIDE * 2 + stages * KEYS_PER_BLOCK * ROW_STRIDE * 2
            + pairs * 16 * PROB_STRIDE * 2 + pairs * 2 * 16 * 4)


@dataclass(frozen=True)
class AttentionPlan:
    pairs: int         # warp pairs per block: 16 query rows each
    stages: int        # key-ring depth
    row_tiles: int     # blocks along the query rows
    prefix_splits: int # P: equal chunks of the committed prefix
    tree_own: bool     # the tree keys get their own split (else they end the last prefix split)
    smem: int

    @property
    def splits(self) -> int:
        return self.prefix_splits + int(self.tree_own)

    @property
    def kernel(self) -> str:
        return f"mla_attention_p{self.pairs}_s{self.stages}"


def plan_attention(q: int, heads: int, context: int, sm_count: int, smem_limit: int,
                   pairs: int | None = None, stages: int | None = None, splits: int | None = None) -> AttentionPlan:
    """Rows per block: one pair (16 rows) while q * H <= 64 (bandwidth-bound: many small blocks split the
    keys), two up to 256 rows, else four (as far as the shared memory allows). Prefix splits: enough blocks for two per SM, chunks of at least
    MIN_CHUNK keys. `pairs`, `stages`, `splits` force a choice (benchmark sweeps)."""
    if not 1 <= q <= MAX_Q:
        raise ValueError(f"MLA tree attention: q = {q} new tokens outside [1, {MAX_Q}]")
    if not 1 <= heads <= MAX_HEADS:
        raise ValueError(f"MLA tree attention: heads = {heads} outside [1, {MAX_HEADS}]")
    if context < 0:
        raise ValueError(f"MLA tree attention: context = {context} must be >= 0")
    rows = q * heads
    fits = [(p, s) for p, s in VARIANTS if smem_bytes(p, s) <= smem_limit]
    if not fits:
        raise ValueError(f"MLA tree attention: no compiled variant fits {smem_limit} B of shared memory")
    if pairs is None:          # more rows per block: the keys are re-read from L2 fewer times
        pairs = max(p for p, _ in fits if p <= (1 if rows <= 64 else 2 if rows <= 256 else 4))
    if stages is None:
        stages = max(s for p, s in fits if p == pairs)
    if (pairs, stages) not in VARIANTS:
        raise ValueError(f"MLA tree attention: (pairs, stages) = ({pairs}, {stages}) not compiled; have {VARIANTS}")
    smem = smem_bytes(pairs, stages)
    if smem > smem_limit:
        raise ValueError(f"MLA tree attention: {pairs} pairs x {stages} stages need {smem} B of shared memory; "
                         f"the device allows {smem_limit}")
    row_tiles = math.ceil(rows / (16 * pairs))
    if splits is None:
        per_sm = max(1, min(4, (smem_limit + 1024) // (smem + 1024)))
        want = max(1, (2 if pairs == 1 else 1) * sm_count * min(per_sm, 2) // row_tiles)
        splits = max(1, min(want, math.ceil(context / MIN_CHUNK)))
    if splits < 1:
        raise ValueError(f"MLA tree attention: splits must be >= 1, got {splits}")
    return AttentionPlan(pairs, stages, row_tiles, splits, splits >= 2, smem)


class MlaTreeAttention:
    """Tree-masked absorbed MLA for `heads` heads and up to max_q new tokens over up to max_context keys."""

    def __init__(self, gpu: Gpu, heads: int, scale: float, max_q: int = MAX_Q, max_context: int = 131072,
                 pdl: bool = True):
        """scale: the softmax scale of the model (KimiConfig.softmax_scale: 192^-1/2 times the YaRN mscale^2)."""
        self.gpu, self.heads, self.scale, self.max_q, self.max_context = gpu, heads, float(scale), max_q, max_context
        self.pdl = pdl and supports_pdl(gpu)
        plan_attention(max_q, heads, max_context, gpu.sm_count, gpu.smem_optin)   # validates the arguments
        # splits grow with the context, so the plans at max_context bound the partial rows
        self._part_rows = max([1] + [p.splits * q * heads for q in range(1, max_q + 1)
                                     for p in [self.plan(q, max_context)] if p.splits > 1])
        self.part_o = gpu.alloc(self._part_rows * LATENT, np.float32)
        self.part_lse = gpu.alloc(self._part_rows, np.float32)
        self._overrides: dict[tuple[int, int], AttentionPlan] = {}

    def plan(self, q: int, context: int) -> AttentionPlan:
        key = (q, context)
        if key in getattr(self, "_overrides", {}):
            return self._overrides[key]
        return plan_attention(q, self.heads, context, self.gpu.sm_count, self.gpu.smem_optin)

    def override(self, q: int, context: int, **forced) -> AttentionPlan:
        """Benchmark sweeps: force pairs / stages / splits for (q, context); grows the workspace if needed."""
        p = plan_attention(q, self.heads, context, self.gpu.sm_count, self.gpu.smem_optin, **forced)
        need = p.splits * q * self.heads
        if p.splits > 1 and need > self._part_rows:
            self.part_o = self.gpu.alloc(need * LATENT, np.float32)
            self.part_lse = self.gpu.alloc(need, np.float32)
            self._part_rows = need
        self._overrides[(q, context)] = p
        return p

    def run(self, q_lat: DeviceArray | int, q_rope: DeviceArray | int, cache: DeviceArray | int,
            vis: DeviceArray | int, lengths: DeviceArray | int, q: int, out: DeviceArray | int,
            lse: DeviceArray | int | None = None, context_hint: int | None = None, stream=None) -> AttentionPlan:
        """Launch (no host sync). context_hint picks the plan (default max_context); T comes from lengths."""
        if not 1 <= q <= self.max_q:
            raise ValueError(f"MLA tree attention: q = {q} outside [1, {self.max_q}]")
        context = self.max_context if context_hint is None else context_hint
        if not 0 <= context <= self.max_context:
            raise ValueError(f"MLA tree attention: context_hint {context} outside [0, {self.max_context}]")
        p = self.plan(q, context)
        rows = q * self.heads
        if p.splits > 1 and p.splits * rows > self._part_rows:
            raise ValueError(f"MLA tree attention: plan {p} needs {p.splits * rows} partial rows; "
                             f"the workspace has {self._part_rows}")
        scale_log2 = np.float32(self.scale * math.log2(math.e))
        self.gpu.allow_smem(SOURCE, p.kernel, p.smem)
        self.gpu.launch(self.gpu.kernel(SOURCE, p.kernel), (p.row_tiles, p.splits), p.pairs * 64, p.smem,
                        ptr(q_lat), ptr(q_rope), ptr(cache), ptr(vis), ptr(lengths), ptr(out), ptr(lse),
                        ptr(self.part_o), ptr(self.part_lse), np.int32(rows), np.int32(self.heads), np.int32(q),
                        np.int32(p.prefix_splits), np.int32(int(p.tree_own)), scale_log2,
                        stream=stream, pdl=self.pdl)
        if p.splits > 1:
            self.gpu.launch(self.gpu.kernel(SOURCE, "mla_attention_combine"), rows, 128, 0,
                            ptr(self.part_o), ptr(self.part_lse), ptr(out), ptr(lse), np.int32(rows),
                            np.int32(p.splits), stream=stream, pdl=self.pdl)
        return p
