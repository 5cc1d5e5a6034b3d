"""The executor contract: what every executor does, and the float64 reference executor.

Every executor (NumpyExecutor here; EngineExecutor, GraphExecutor, CudaExecutor) subclasses Executor. The decode
loops (runtime/loop.py), the engine (runtime/engine.py) and the server call only what it names:

    primitives (docs/interfaces.md section 6; each executor runs description/stack.py underneath)
        new_target_cache(capacity, limit) / new_drafter_cache(capacity, limit)
        target_forward(ids, pos, visible, cache, taps) -> logits [q, V], {L: h [q, H]}
        drafter_forward(block_ids, pos, ctx_taps, cache) -> logits [b-1, V]
        compact(cache, start, keep)
        sample(logits, positions, params) -> tokens
        tree_build(root_token, draft_logits, budget) -> Tree
        accept_walk(tree, target_tokens) -> WalkResult
    abilities (typed attributes, None where the executor lacks one: the loop then composes the primitives)
        ar_step(state, params) -> tokens            one whole AR step (a captured GPU graph)
        ddtree_step(state, params, budget) -> tokens one whole DDTree step
        drafter_prefill(state)                      ingests the prompt's drafter context during the prefill
        verify_requests(calls) -> [(logits, taps)]  Rq target_forward calls [(ids, pos, visible, cache, taps)] as
                                                    ONE forward over their union rows (the batched step's verify;
                                                    runtime/batch.py uses it, else the requests take turns)
        steps                                       the GPU step graphs (their counters: steps.stats())
        prune_forward(ids, pos, visible, cache, taps, pruning) -> like target_forward, the verify pruned inside
                                                    (description/stack.py Pruning; --prune auto, issue 53)
        prunes_in_step                              True where ddtree_step prunes when the state asks (its
                                                    prune: a Pruner); else the loop composes the pruned steps
        lane_pool(n) -> LanePool                    n request lanes on the device (runtime/cuda_lanes.py: the GPU's
                                                    batched step; runtime/batch.py check_batchable asks for them)
        bind_thread()                               make the device current on the calling thread (a server's
                                                    engine thread: a GPU context is per thread)
    device_stats() -> dict                          the device, its memory plan, the step graphs' counters

`NumpyExecutor` is the float64 reference. A GPU executor provides the same names (and may fuse a whole step
into one captured CUDA graph), with results equal to these primitives'.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable

import numpy as np

from ddtree.reference.cache import LatentCache
from ddtree.reference.drafter import DraftCache, Drafter
from ddtree.reference.model import Target
from ddtree.tree.build import Tree, build_tree, topk_logprobs
from ddtree.tree.sampling import SamplingParams, sample
from ddtree.tree.walk import WalkResult, accept_walk


class Executor(ABC):
    name: str                                             # "numpy", "engine-numpy", "engine-graphs", "cuda", ...
    config: object                                        # the target's KimiConfig
    drafter_config: object | None                         # the drafter's DrafterConfig (None: AR only)
    tokenizer_dir: Path | None = None                     # an engine's tokenizer/ (None: the checkpoint's own)
    ar_step: Callable | None = None
    ddtree_step: Callable | None = None
    drafter_prefill: Callable | None = None
    verify_requests: Callable | None = None
    steps: object | None = None
    prune_forward: Callable | None = None
    prunes_in_step: bool = False
    lane_pool: Callable | None = None
    bind_thread: Callable | None = None

    @abstractmethod
    def new_target_cache(self, capacity: int = 256, limit: int | None = None): ...

    @abstractmethod
    def new_drafter_cache(self, capacity: int = 256, limit: int | None = None): ...

    @abstractmethod
    def target_forward(self, ids, pos, visible, cache, taps=()) -> tuple[np.ndarray, dict]: ...

    @abstractmethod
    def drafter_forward(self, block_ids, pos, ctx_taps, cache) -> np.ndarray: ...

    @abstractmethod
    def compact(self, cache, start: int, keep) -> None: ...

    @abstractmethod
    def sample(self, logits, positions, params: SamplingParams) -> np.ndarray: ...

    @abstractmethod
    def tree_build(self, root_token: int, draft_logits: np.ndarray, budget: int) -> Tree: ...

    def accept_walk(self, tree: Tree, target_tokens) -> WalkResult:
        return accept_walk(tree, target_tokens)

    def device_stats(self) -> dict:
        return {}


class NumpyExecutor(Executor):
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
