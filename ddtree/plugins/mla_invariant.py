"""Launcher for the batch-invariant tree-masked MLA attention (kernels/mla_invariant.cu): the attention of the
batch-invariant kernel plan (`--kernel-plan batch-invariant`, docs/interfaces.md section 6).

    attn = MlaInvariantAttention(gpu, heads=8, scale=cfg.softmax_scale, latent=512, rope=64, max_context=4096)
    attn.run(q_lat, q_rope, cache_layer, vis, lengths, q, out, lse=None)      # MlaTreeAttention.run's contract

Each (query row, head) walks its visible keys in position order (prefix, then the ancestor chain by depth) in
chunks and splits aligned to absolute positions, so a tree node's output is bitwise the one-token decode's at
the same position with the same cache contents: no choice depends on q, the tree or the other rows. It is
one warp per (split of 256 positions, head, row), far slower than the fast forms: a plan for proving
losslessness bitwise, not for serving (`ddtree bench e2e --device cuda --kernel-plan batch-invariant` measures
what the whole plan costs).
"""
from __future__ import annotations

import math

import numpy as np

from ddtree.plugins.compile import latent_defines
from ddtree.plugins.device import DeviceArray, Gpu, ptr
from ddtree.plugins.gemm import supports_pdl

SOURCE = "mla_invariant.cu"
SPLIT = 256                     # INV_SPLIT: positions per split
MAX_Q = 256                     # INV_MAX_Q


class MlaInvariantAttention:
    """The batch-invariant attention for `heads` heads, up to MAX_Q rows, over a cache of up to max_context rows."""

    def __init__(self, gpu: Gpu, heads: int, scale: float, *, latent: int, rope: int, max_q: int = MAX_Q,
                 max_context: int = 131072, pdl: bool = True):
        self.defines = latent_defines(latent, rope)          # LatentDimsError before anything compiles
        if not 1 <= max_q <= MAX_Q:
            raise ValueError(f"MLA invariant attention: max_q = {max_q} outside [1, {MAX_Q}]")
        if heads < 1 or max_context < 1:
            raise ValueError(f"MLA invariant attention: heads {heads} and max_context {max_context} must be >= 1")
        self.gpu, self.heads, self.scale, self.max_q, self.max_context = gpu, heads, float(scale), max_q, max_context
        self.latent, self.rope = latent, rope
        self.pdl = pdl and supports_pdl(gpu)
        self.splits = -(-max_context // SPLIT)               # a row has at most max_context keys
        rows = max_q * heads * self.splits
        self.part_o = gpu.alloc(rows * latent, np.float32)
        self.part_ml = gpu.alloc(rows * 2, np.float32)

    def run(self, q_lat: DeviceArray | int, q_rope: DeviceArray | int, cache: DeviceArray | int,
            vis: DeviceArray | int, lengths: DeviceArray | int, q: int, out: DeviceArray | int,
            lse: DeviceArray | int | None = None, context_hint: int | None = None, stream=None) -> None:
        """Launch (no host sync); T comes from lengths, and T + q must be at most max_context (the cache's
        rows). context_hint is accepted for MlaTreeAttention's signature and unused: the grid covers
        max_context, and splits past a row's keys return at once."""
        if not 1 <= q <= self.max_q:
            raise ValueError(f"MLA invariant attention: q = {q} outside [1, {self.max_q}]")
        scale_log2 = np.float32(self.scale * math.log2(math.e))
        g = self.gpu
        g.launch(g.kernel(SOURCE, "mla_invariant_split", self.defines), (self.splits, self.heads, q), 32, 0,
                 ptr(q_lat), ptr(q_rope), ptr(cache), ptr(vis), ptr(lengths), ptr(self.part_o), ptr(self.part_ml),
                 np.int32(q), scale_log2, stream=stream, pdl=self.pdl)
        g.launch(g.kernel(SOURCE, "mla_invariant_combine", self.defines), (q, self.heads), 128, 0,
                 ptr(self.part_o), ptr(self.part_ml), ptr(vis), ptr(lengths), ptr(out), ptr(lse), np.int32(q),
                 np.int32(self.splits), stream=stream, pdl=self.pdl)
