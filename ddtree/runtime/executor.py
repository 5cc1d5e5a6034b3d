"""Executors: the primitives the decode loops are written over (docs/interfaces.md section 6).

    target_forward(ids, pos, visible, cache, taps) -> logits [q, V], {L: h [q, H]}
    drafter_forward(block_ids, pos, ctx_taps, cache) -> logits [b-1, V]
    compact(cache, start, keep)
    sample(logits, positions, params) -> tokens
    tree_build(root_token, draft_logits, budget) -> Tree
    accept_walk(tree, target_tokens) -> WalkResult

`NumpyExecutor` is the float64 reference. A GPU executor provides the same names (and may fuse a
whole step into one captured CUDA graph), with results equal to these primitives'.
"""
from __future__ import annotations

import numpy as np

from ddtree.reference.cache import LatentCache
from ddtree.reference.drafter import DraftCache, Drafter
from ddtree.reference.model import Target
from ddtree.tree.build import Tree, build_tree, topk_logprobs
from ddtree.tree.sampling import SamplingParams, sample
from ddtree.tree.walk import WalkResult, accept_walk


class NumpyExecutor:
    name = "numpy"

    def __init__(self, target: Target, drafter: Drafter | None = None):
        self.target, self.drafter = target, drafter
        self.config = target.config
        self.drafter_config = drafter.config if drafter is not None else None

    # caches ------------------------------------------------------------------------------------
    def new_target_cache(self, capacity: int = 256, limit: int | None = None) -> LatentCache:
        """`capacity` rows now, grown by doubling on demand up to `limit` rows (None: no limit)."""
        c = self.config
        return LatentCache(c.num_hidden_layers, c.kv_lora_rank, c.qk_rope_head_dim, self.target.dtype, capacity, limit)

    def new_drafter_cache(self, capacity: int = 0, limit: int | None = None) -> DraftCache:
        """The reference drafter cache holds exactly the rows appended (no preallocation, so no limit to keep)."""
        return self.drafter.new_cache()

    # primitives --------------------------------------------------------------------------------
    def target_forward(self, ids, pos, visible, cache, taps=()):
        return self.target.forward(ids, pos, visible, cache, taps)

    def drafter_forward(self, block_ids, pos, ctx_taps, cache) -> np.ndarray:
        return self.drafter.forward(block_ids, pos, ctx_taps, cache)

    def compact(self, cache, start: int, keep) -> None:
        cache.compact(start, keep)

    def sample(self, logits, positions, params: SamplingParams) -> np.ndarray:
        return sample(logits, positions, params)

    def tree_build(self, root_token: int, draft_logits: np.ndarray, budget: int) -> Tree:
        logp, ids = topk_logprobs(draft_logits, budget)                 # [D, min(B, V)]
        return build_tree(root_token, logp, ids, budget)

    def accept_walk(self, tree: Tree, target_tokens) -> WalkResult:
        return accept_walk(tree, target_tokens)
