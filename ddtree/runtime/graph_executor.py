"""The executor primitives (docs/interfaces.md section 6) over an engine's per-rank graphs, graph kind by graph kind.

    ex = GraphExecutor(GraphRanks.from_engine(engine_dir, act="float64"))    # onnx.reference, every rank a thread
    ex = GraphExecutor(PlanRanks(engine_dir))                                  # --device tensorrt (trt_executor.py)
    tokens = run_to_end(ddtree_steps(ex, prompt_ids, 64, SamplingParams(), 16))

`ranks` runs the graph kinds the engine exported (runtime/graph_ranks.py GraphRanks: embed, dense/moe layers, head,
draft_fc, draft layers, draft_head, compact) and returns every rank's logits slices side by side; the loop's
sampling, tree build and walk run here on the host from those full logits, exactly as EngineExecutor's
(runtime/vocab_parallel.py over the ranks' slices), so an engine's graphs decode a prompt with the same loop as every
other executor. Caches are the ranks' host arrays (runtime/caches.py), grown on demand. Whatever runs the graphs
(onnx.reference on the CPU, TensorRT-RTX plans on an SM120 GPU) only has to implement GraphRanks.run.
"""
from __future__ import annotations

import numpy as np

from ddtree.runtime import vocab_parallel
from ddtree.runtime.caches import DraftCaches, TargetCaches
from ddtree.runtime.engine_executor import checked_drafter_inputs, checked_forward_inputs
from ddtree.runtime.executor import Executor
from ddtree.runtime.graph_ranks import mask_words
from ddtree.tree.build import Tree, build_tree
from ddtree.tree.sampling import SamplingParams


class GraphExecutor(Executor):
    def __init__(self, ranks, name: str = "engine-graphs", host_group=None, tokenizer_dir=None):
        """host_group: when `ranks` holds one rank of several (a rank process), the ranks' host group
        (parallel/shm_group.py) through which the logits slices are gathered, so every rank samples, builds and walks
        the same tree from the same bits (runtime/ranks.py)."""
        self.ranks, self.name, self.host_group, self.tokenizer_dir = ranks, name, host_group, tokenizer_dir
        self.config, self.drafter_config = ranks.cfg, ranks.dcfg
        if ranks.held < ranks.tp and host_group is None:
            raise ValueError(f"GraphExecutor: {ranks.held} of {ranks.tp} ranks here; the others' logits need a "
                             "host group")

    def _gathered(self, logits) -> np.ndarray:
        logits = np.asarray(logits, np.float64)
        if self.ranks.held == self.ranks.tp:
            return logits
        parts = self.host_group.all_gather(self.ranks.local[0], logits, "logits slices")   # [tp, q, V_r]
        return np.concatenate(list(parts), axis=1)

    # caches ------------------------------------------------------------------------------------
    def new_target_cache(self, capacity: int = 256, limit: int | None = None) -> TargetCaches:
        return self.ranks.new_target_caches(capacity if limit is None else min(capacity, limit), limit)

    def new_drafter_cache(self, capacity: int = 256, limit: int | None = None) -> DraftCaches:
        return self.ranks.new_drafter_caches(capacity if limit is None else min(capacity, limit), limit)

    # primitives --------------------------------------------------------------------------------
    def target_forward(self, ids, pos, visible, cache: TargetCaches, taps=()):
        """ids [q], pos [q], visible [q, T+q] -> logits [q, V] (the ranks' slices side by side), {L: h [q, H]}."""
        T = cache.length
        ids, pos, visible = checked_forward_inputs(ids, pos, visible, T, self.config.vocab_size)
        cache.reserve(T + len(ids))
        out = self.ranks.target_forward(ids, pos, mask_words(visible[:, T:]), cache, tuple(taps))
        return self._gathered(out.logits), {L: np.asarray(h, np.float64) for L, h in out.taps.items()}

    def drafter_forward(self, block_ids, pos, ctx_taps, cache: DraftCaches) -> np.ndarray:
        """block_ids [b], pos [b], ctx_taps [n, K H] -> draft logits [b-1, V]."""
        ctx_taps = checked_drafter_inputs(ctx_taps, block_ids, self.drafter_config)
        cache.reserve(cache.length + len(ctx_taps))
        return self._gathered(self.ranks.drafter_forward(np.asarray(block_ids), np.asarray(pos), ctx_taps,
                                                         cache).logits)

    def compact(self, cache: TargetCaches, start: int, keep) -> None:
        keep = np.asarray(keep, np.int32).reshape(-1)
        if not 0 <= start <= cache.length:
            raise ValueError(f"compact: start {start} must be within the cache length {cache.length}")
        q = cache.length - start                           # the verify's rows: the graph takes [nodes] indices
        accepted = np.full(max(q, len(keep)), -1, np.int32)
        accepted[: len(keep)] = keep
        self.ranks.compact(cache, start, accepted, len(keep))

    def sample(self, logits, positions, params: SamplingParams) -> np.ndarray:
        return vocab_parallel.sample(*vocab_parallel.split_logits(logits, self.ranks.layouts), positions, params)

    def tree_build(self, root_token: int, draft_logits: np.ndarray, budget: int) -> Tree:
        logp, ids = vocab_parallel.topk_logprobs(*vocab_parallel.split_logits(draft_logits, self.ranks.layouts),
                                                 budget)
        return build_tree(root_token, logp, ids, budget)
