"""`--prune auto` inside the GPU DDTree step graph (issue 53; runtime/cuda_step.py GpuSteps, tp 1).

    sp = StepPruning(steps, pruner)          # device buffers, made once per GpuSteps
    sp.prepare(pruner, budget, start)        # host, before a step: the rate's terms at this budget and context
    pruning = sp.verify_feeds(tree, n, stream, stats)  # inside the graph: path probs + rate on the device
    h = target_layers(ex, feeds, cache, tap, taps, prune=pruning)      # the pruned verify (description/stack.py)
    tree_for_walk = sp.walk_tree(tree, pruning.feeds["live"], n, stream)   # dead nodes' tokens -1
    sp.finish(n, stream)                                 # the final live mask into host-mapped memory
    sp.record(n, stats)                                  # host, after the step's record: the pruner's PruneStats

The step is what runtime/loop.py ddtree_step does on the host with runtime/pruning.py Pruner.verify, without a host
round trip: path probabilities from the tree build's fp32 path log-probabilities through the tuning file's
calibration (plugins/prune_ops.py prune_path_probs), the rate base + per_token x their sum (Pruner.rate_terms, the
terms written by the host before each step), tree_prune at the pruner's layers, moe_live at every MoE layer, the
walk over the masked tokens. The stats are copied into host-mapped buffers inside
the graph and read once the step's record is (a pruned step is never enqueued ahead of the host: the next step
would overwrite them while they are read, and its rate's context is the host's): the pruned nodes every step (one
copy of the final mask), the distinct experts before / after at every MoE layer only on a stats step (two copies
a MoE layer: 120 copy nodes on Kimi, enough to eat the experts a pruned step saves), the first pruned step of a
request and every STATS_EVERY-th after it (its own graph; runtime/pruning.py PruneStats averages what it saw). Letters: n tree nodes (<= N = the ops' max rows), m MoE layers, k = topk.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ddtree.backends.cuda_tensor import Tensor
from ddtree.description import stack
from ddtree.plugins.prune_ops import CalibrationTable
from ddtree.tree.budget import CALIBRATION_BINS

TABLE_POINTS = CALIBRATION_BINS + 2         # the device calibration table's points a depth (a fitted map's at most)
STATS_EVERY = 8                             # pruned steps per stats step (the distinct experts' copies)


class StepPruning:
    def __init__(self, steps, pruner):
        g, ops, cfg = steps.gpu, steps.ops, steps.ex.config
        self.gpu, self.ops, self.pruner = g, ops, pruner
        N, k = ops.max_tokens, cfg.num_experts_per_tok
        self.moe = {L: j for j, L in enumerate(cfg.moe_layers)}
        self.N, self.k = N, k
        self.ones = g.upload(np.ones(N, np.int32))                  # the root's live mask: every node (never written)
        self.path_prob, self.rate = g.alloc((N,), np.float32), g.alloc((1,), np.float32)
        self.rate_terms = g.zeros(2, np.float32)
        self.expert_bytes = g.upload(np.array([pruner.expert_bytes], np.int32))
        self.depths = max(steps.B_max - 1, 1)
        table = self._table(pruner)
        self.table = {"x": g.upload(table.x), "y": g.upload(table.y), "n": g.upload(table.n)}
        self.masked = g.alloc((N,), np.int32)
        self.routed_host, self.routed_dev = g.mapped((len(self.moe), N, k), np.int32)     # [m, N, k]
        self.lives_host, self.lives_dev = g.mapped((len(self.moe), N), np.int32)          # [m, N] live it routed with
        self.final_host, self.final_dev = g.mapped((N,), np.int32)                        # [N] after the verify
        self.live = None                                            # the verify's final mask (a Tensor)
        self.pruned_steps = 0                                       # of this request (stats_due)

    def _table(self, pruner) -> CalibrationTable:
        return CalibrationTable.of(pruner.calibration, self.depths, TABLE_POINTS)

    def prepare(self, pruner, budget: int, start: int) -> None:
        """Host, before a step the host starts: the step's rate terms (the tuning file's rate depends on the budget
        and the context), and another pruner's constants written over the same buffers (the captured graphs read
        them; its layers are in the graph's key, runtime/cuda_step.py)."""
        if pruner is not self.pruner:
            table = self._table(pruner)
            for name in ("x", "y", "n"):
                self.gpu.copy_in(self.table[name], getattr(table, name))
            self.gpu.copy_in(self.expert_bytes, np.array([pruner.expert_bytes], np.int32))
            self.pruner = pruner
        self.gpu.copy_in(self.rate_terms, np.array(pruner.rate_terms(budget, start), np.float32))

    def stats_due(self, first: bool) -> bool:
        """Whether this pruned step (the first of a request: `first`) copies the distinct experts (a stats step)."""
        self.pruned_steps = 0 if first else self.pruned_steps + 1
        return self.pruned_steps % STATS_EVERY == 0

    def verify_feeds(self, tree, n: int, stream, stats: bool = True) -> stack.Pruning:
        """Inside the graph: path_prob [n] and the rate on the device -> the stack's Pruning over device feeds.
        stats: every MoE layer's routing and live mask copied for record (a stats step)."""
        self.ops.prune_kernels().path_probs(tree.scores, tree.parents, tree.depth, n, self.table, self.rate_terms,
                                            self.path_prob, self.rate, stream=stream)
        feeds = {"live": Tensor.of(self.ones.view(0, (n,))), "parents": Tensor.of(tree.parents),
                 "path_prob": Tensor.of(self.path_prob.view(0, (n,))), "prune_rate": Tensor.of(self.rate),
                 "expert_bytes": Tensor.of(self.expert_bytes)}
        g, N, k = self.gpu, self.N, self.k

        def on_route(L: int, ids, live) -> None:          # MoE layer L's routing and the mask it routed with
            j = self.moe[L]
            g.copy_d2d(self.routed_dev + j * N * k * 4, ids.ptr, n * k * 4, stream=stream)
            g.copy_d2d(self.lives_dev + j * N * 4, live.ptr, n * 4, stream=stream)
        return stack.Pruning(self.pruner.at, feeds, on_route if stats else None)

    def walk_tree(self, tree, live: Tensor, n: int, stream):
        """The tree the sampler's walk reads: dead nodes' tokens -1 (the committed tokens still come from tree)."""
        self.live = live
        self.ops.prune_kernels().mask_dead(tree.tokens, live.ptr, self.masked, n, stream=stream)
        return replace(tree, tokens=self.masked.view(0, (n,)))

    def finish(self, n: int, stream) -> None:
        self.gpu.copy_d2d(self.final_dev, self.live.ptr, n * 4, stream=stream)

    def record(self, n: int, experts: bool = True) -> None:
        """Host, after the step finished: the pruner's stats as runtime/pruning.py Pruner.verify keeps them (the
        distinct experts only after a stats step: `experts`)."""
        stats = self.pruner.stats
        for j in range(len(self.moe) if experts else 0):
            stats.add_layer(self.routed_host[j, :n], self.lives_host[j, :n])
        stats.add_step(self.final_host[:n])
