"""Launcher for the DFlash drafter's block attention (kernels/draft_attention.cu), the attention half of the op
set's draft_attention:

    attn = DraftAttention(gpu, heads=Hq_r, kv_heads=Hk_r, head_dim=d, max_block=16, max_context=S)
    attn.run(q, k, v, cache_k, cache_v, cache_len, n, pos, o, b, window=W)

q [b, Hq_r, d], k / v [b, Hk_r, d] (the block, roped), cache_k / cache_v [S, Hk_r, d] holding rows
[0, cache_len[0] + n): the caller ropes the n new context rows and appends them at cache_len.. first (the
rope and append kernels), as the op's numpy form does before its attention. cache_len int32 [1] and pos
int32 [b] are device buffers (a captured graph serves every step); n, b and the window are the call's
shape (static per graph). Non-causal over the context and the block, GQA, softmax scale d^-1/2, sliding
window by positions (pos[i] - k_pos < window; 0: none) -> o [b, Hq_r d] bf16.

The key splits are fixed at construction from max_context (the cache capacity): enough blocks to fill the
GPU at the longest context; a split past the live keys costs one empty block, never a wrong answer.
"""
from __future__ import annotations

import math

import numpy as np

from ddtree.plugins.device import DeviceArray, Gpu, ptr
from ddtree.plugins.gemm import supports_pdl

SOURCE = "draft_attention.cu"
HEAD_DIMS = (32, 64, 128)
ROWS_PER_BLOCK = 32                     # DA_ROWS in draft_attention.cu
TILE = 32                               # DA_TILE
MAX_BLOCK = 16
MAX_SPLITS = 160                        # DA_MAX_SPLITS: the combine's weights in shared memory
COMBINE_THREADS = 1024                  # DA_COMBINE_THREADS: head_dim x split groups
KEYS_PER_SPLIT = 32                     # at least this many keys (one tile) per split at the longest context
BLOCKS_PER_SM = 4


def plan_splits(kv_heads: int, rows: int, keys: int, sm_count: int) -> int:
    """Key splits for `rows` = b g query rows per kv head and up to `keys` keys: about BLOCKS_PER_SM blocks per SM,
    at most one split per SM, each split at least KEYS_PER_SPLIT keys. H200 (tests/plugins/sweep_draft_attention.py,
    block 8, us with the combine): Kimi's tp 8 drafter (2 row blocks) at 4K keys 9 / 33 / 65 / 132 splits 87.9 /
    31.2 / 25.8 / 23.4, at 32K 609 / 180 / 122 / 87.7; tp 1 (16 row blocks) at 4K 9 / 17 / 33 / 65 splits 117.7 /
    89.1 / 67.2 / 76.7, at 32K 812 / 574 / 416 / 418."""
    blocks = kv_heads * -(-rows // ROWS_PER_BLOCK)
    return max(1, min(MAX_SPLITS, sm_count, -(-BLOCKS_PER_SM * sm_count // blocks), -(-keys // KEYS_PER_SPLIT)))


class DraftAttention:
    def __init__(self, gpu: Gpu, heads: int, kv_heads: int, head_dim: int, max_block: int = MAX_BLOCK,
                 max_context: int = 4096, scale: float | None = None, pdl: bool = True, splits: int | None = None):
        """splits: force the key splits of every launch (sweeps); default plan_splits."""
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"draft attention: head_dim {head_dim} must be one of {HEAD_DIMS}")
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"draft attention: {heads} query heads must be a multiple of {kv_heads} kv heads")
        if not 1 <= max_block <= MAX_BLOCK or max_context < 1:
            raise ValueError(f"draft attention: max_block {max_block} must be in [1, {MAX_BLOCK}], "
                             f"max_context {max_context} >= 1")
        self.gpu, self.heads, self.kv_heads, self.d = gpu, heads, kv_heads, head_dim
        self.max_block, self.max_context = max_block, max_context
        if splits is not None and not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"draft attention: splits {splits} must be in [1, {MAX_SPLITS}]")
        self.forced_splits = splits
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.pdl = pdl and supports_pdl(gpu)
        worst = max(self.splits(b) for b in range(1, max_block + 1))
        rows = max_block * heads
        self.part_o = gpu.alloc((worst, rows, head_dim) if worst > 1 else 1, np.float32)
        self.part_ml = gpu.alloc((worst, rows, 2) if worst > 1 else 1, np.float32)

    def splits(self, b: int) -> int:
        if self.forced_splits:
            return self.forced_splits
        return plan_splits(self.kv_heads, b * (self.heads // self.kv_heads), self.max_context + b, self.gpu.sm_count)

    def run(self, q: DeviceArray | int, k: DeviceArray | int, v: DeviceArray | int, cache_k: DeviceArray | int,
            cache_v: DeviceArray | int, cache_len: DeviceArray | int, n: int, pos: DeviceArray | int,
            o: DeviceArray | int, b: int, window: int = 0, q_tok: int | None = None, kv_tok: int | None = None,
            stream=None, v_tok: int | None = None) -> int:
        """Launch (and combine when split); returns the number of key splits."""
        if not 1 <= b <= self.max_block or n < 0 or window < 0:
            raise ValueError(f"draft attention: b {b} must be in [1, {self.max_block}], n {n} and window "
                             f"{window} >= 0")
        q_tok = self.heads * self.d if q_tok is None else q_tok
        kv_tok = self.kv_heads * self.d if kv_tok is None else kv_tok
        v_tok = kv_tok if v_tok is None else v_tok               # v of its own stride: a slice of q | k | v
        if q_tok % 8 or kv_tok % 8 or v_tok % 8:
            raise ValueError(f"draft attention: token strides {q_tok}, {kv_tok}, {v_tok} must be multiples of 8")
        g = self.heads // self.kv_heads
        splits = self.splits(b)
        grid = (self.kv_heads, -(-b * g // ROWS_PER_BLOCK), splits)
        self.gpu.launch(self.gpu.kernel(SOURCE, f"draft_attention_d{self.d}"), grid, 256, 0,
                        ptr(q), np.int32(q_tok), ptr(k), ptr(v), np.int32(kv_tok), np.int32(v_tok), ptr(cache_k),
                        ptr(cache_v), ptr(cache_len), np.int32(n), ptr(pos), np.int32(b), np.int32(self.heads),
                        np.int32(self.kv_heads), np.int32(window), np.float32(self.scale * math.log2(math.e)),
                        ptr(self.part_o), ptr(self.part_ml), ptr(o), stream=stream, pdl=self.pdl)
        if splits > 1:
            groups = max(1, min(COMBINE_THREADS // self.d, splits))          # split groups a row block sums
            self.gpu.launch(self.gpu.kernel(SOURCE, "draft_attention_combine"), b * self.heads, (self.d, groups, 1), 0,
                            ptr(self.part_o), ptr(self.part_ml), ptr(o), np.int32(b * self.heads),
                            np.int32(splits), stream=stream, pdl=self.pdl)
        return splits
