"""The op set's pruning ops in the cuda backend (PruneOps, mixed into CudaOps: backends/cuda_backend.py; issue 53).

    tree_prune        plugins/tree_prune.py TreePrune (kernels/tree_prune.cu), one block, live_out in the arena;
                      its horizon (a python int) a scalar launch argument
    accept_walk_live  plugins/prune_ops.py mask_dead (dead nodes' tokens -1: no target token equals them, so the walk
                      never enters a dead node; tree/prune.py absent_tree), then the accept_walk op on those tokens
    moe_live          backends/cuda_moe.py (the router's ids rewritten for dead rows inside the routing launch,
                      before its alignment)
"""
from __future__ import annotations

import numpy as np

from ddtree.plugins.prune_ops import PruneOps as PruneKernels
from ddtree.plugins.tree_prune import TreePrune
from ddtree.tree.prune import MAX_EXPERTS

PRUNE_LAUNCHERS = {
    "moe_live": "backends/cuda_moe.py: the router (one launch: the live mask applied before its alignment, dead rows "
                "onto the root's experts at weight 0, the routed ids written beside; kernels/route_common.cuh "
                "live_rows), the experts",
    "tree_prune": "plugins/tree_prune.py TreePrune (kernels/tree_prune.cu: one block)",
    "accept_walk_live": "plugins/prune_ops.py mask_dead, then accept_walk (plugins/vocab_nodes.py AcceptWalk)",
}


class PruneOps:
    def prune_kernels(self) -> PruneKernels:
        return self.launcher(("prune_ops",), lambda: PruneKernels(self.gpu))

    def tree_prune(self, live, parents, path_prob, routed_ids, rate, expert_bytes, horizon):
        q, k = routed_ids.shape
        self._dense("tree_prune", (live, np.int32), (parents, np.int32), (path_prob, np.float32),
                    (routed_ids, np.int32), (rate, np.float32), (expert_bytes, np.int32))
        if live.shape != (q,) or parents.shape != (q,) or path_prob.shape != (q,):
            raise ValueError(f"{self.where}: tree_prune of live {live.shape}, parents {parents.shape}, path_prob "
                             f"{path_prob.shape} and routed_ids {routed_ids.shape} ([q] and [q, topk])")
        # MAX_EXPERTS counts: every global id (< n_routed_experts <= 512) is counted, as by the twin's default
        prune = self.launcher(("tree_prune", k), lambda: TreePrune(self.gpu, k, MAX_EXPERTS))
        out = self.new((q,), np.int32)
        prune.run(live.ptr, parents.ptr, path_prob.ptr, routed_ids.ptr, rate.ptr, expert_bytes.ptr, out.ptr, q,
                  horizon, stream=self.stream)            # horizon: a scalar argument, kept by a captured graph
        return out

    def masked_tokens(self, tokens, live):
        """tokens [n] with dead nodes' -1 (a new arena buffer)."""
        n = tokens.shape[0]
        self._dense("mask_dead", (tokens, np.int32), (live, np.int32))
        if live.shape != (n,):
            raise ValueError(f"{self.where}: the live mask {live.shape} of a tree of {n} nodes")
        out = self.new((n,), np.int32)
        self.prune_kernels().mask_dead(tokens.ptr, live.ptr, out.ptr, n, stream=self.stream)
        return out

    def accept_walk_live(self, tokens, parents, win_value, win_id, live):
        return self.accept_walk(self.masked_tokens(tokens, live), parents, win_value, win_id)
