"""Launcher of the tree pruning kernel (kernels/tree_prune.cu; issue 53) and its numpy twin.

    prune = TreePrune(gpu, top_k=8, n_experts=384)
    prune.run(live, parents, path_prob, routed_ids, rate, expert_bytes, live_out, q, horizon, stream)

One launch of one block: the per-expert use counts in shared memory, each node's marginal experts and its drop,
then the subtree drop in node order. The twin is ddtree/tree/prune.py prune_nodes (bit for bit: integer counts,
one float64 multiply and compare). Every tensor argument is a device address (a DeviceArray, an int, or a
cuda-backend Tensor's .ptr): live [q] int32, parents [q] int32, path_prob [q] float32, routed_ids [q, top_k]
int32 (global ids), rate [1] float32 (tokens per expert byte), expert_bytes [1] int32, live_out [q] int32 (it may
be live itself: every read of live precedes the barriers before the one write). horizon (an int, the MoE layers
after this one) is a scalar launch argument: a captured graph keeps the layer's. run() allocates nothing
and never synchronises, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import numpy as np

from ddtree.plugins.device import Gpu, ptr
from ddtree.tree.prune import MAX_EXPERTS, MAX_HORIZON, MAX_NODES, MAX_TOPK, PruneError, prune_nodes

SOURCE, KERNEL = "tree_prune.cu", "tree_prune"
THREADS = 256                   # TP_THREADS

reference = prune_nodes         # the numpy twin


class TreePrune:
    def __init__(self, gpu: Gpu, top_k: int, n_experts: int):
        if not (1 <= top_k <= MAX_TOPK and 1 <= n_experts <= MAX_EXPERTS):
            raise PruneError(f"TreePrune: top_k {top_k} must be in 1..{MAX_TOPK} and n_experts {n_experts} in "
                             f"1..{MAX_EXPERTS} (the kernel's shared-memory counts)")
        self.gpu, self.top_k, self.n_experts = gpu, top_k, n_experts
        self.kernel = gpu.kernel(SOURCE, KERNEL)

    def run(self, live, parents, path_prob, routed_ids, rate, expert_bytes, live_out, q: int, horizon: int,
            stream=None) -> None:
        if not 1 <= q <= MAX_NODES:
            raise PruneError(f"TreePrune: {q} nodes; the kernel's one block takes 1..{MAX_NODES}")
        if not (isinstance(horizon, (int, np.integer)) and 0 <= horizon <= MAX_HORIZON):
            raise PruneError(f"TreePrune: horizon {horizon!r} must be an int in 0..{MAX_HORIZON} (MoE layers left)")
        self.gpu.launch(self.kernel, 1, THREADS, 0, ptr(live), ptr(parents), ptr(path_prob), ptr(routed_ids),
                        ptr(rate), ptr(expert_bytes), ptr(live_out), np.int32(q), np.int32(self.top_k),
                        np.int32(self.n_experts), np.int32(horizon), stream=stream)
