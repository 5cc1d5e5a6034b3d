"""The DDTree and AR step graphs of one rank of a tp > 1 engine (runtime/ranks.py RankProcesses(cuda=...)): each
rank process captures its own graphs, with the collectives inside them, and replays one graph per step, as tp 1
does (runtime/cuda_step.py, whose capture, pipelining, record ring and window this class inherits).

    steps = TpSteps(ex)          # ex: CudaExecutor(rank=r) whose collective is capturable (ProcessRankMember)

A DDTree step graph at tp N, written over the op set's layer functions (ops/layers.py) like the model itself:
    draft        the prologue, draft_fc, the drafter layers (tp 1's), then layers.draft_head: this rank's top-k
                 candidates [D, k] of its vocab slice and its row max / sum-exp parts (VocabTopK)
    tree         layers.tree: the candidates all-gathered [tp, D, k] -> TreeBuild: the ranks' normaliser and the
                 best-first tree (tokens, parents, depth, visibility); its positions start + depth (below)
    verify       embed + every decoder layer over the tree, taps copied; layers.head: this rank's sampling winner
                 at every node (VocabWinner: greedy, or Gumbel at the temperature on the device) for the
                 position start + depth + 1
    sample+walk  layers.accept: the winners all-gathered [tp, n] -> the target token at every node, the walk
    update       compaction, the context window, the record and the state (tp 1's)
The AR step graph: the prologue, embed + layers over the bonus token, layers.head at start + 1, layers.accept
over the one-node tree [bonus] (its target token is the sample), the commit.

Lockstep. The one-shot collectives number their calls on the device (ops/cuda_collectives.py ProcessRankMember),
so every rank must launch the same collectives in the same order: every rank runs the same loop under the same
control records (runtime/ranks.py), and every choice here (graph or primitives, the graph's key, the step
enqueued ahead, the first eager run and the captures) is a function of the state all ranks share.

Sampling. The node kernels sample greedy and plain temperature (Gumbel-max over l / T). Top-k and top-p would
need the ranks' kept sets merged (not written), so a step with either runs the primitives (runtime/loop.py: the
logits slices gathered through the host group, the host's sampler: the definition exactly, no graph); stats()
counts those steps. VocabWinner reads T as float32 (T = 0.8 is 0.8 + 1.2e-8): a token can differ from the
float64 definition's only where two z + g are within that relative 1e-8 (the GPU logits' own error is far larger).

Positions. TreeBuild's best-first writes start + depth into its `positions` workspace from its `start` buffer (a
zero by default): the op set's launcher is made here with `start` = block_pos[0] (the prologue's start), so its
workspace holds the verify's positions. The sampled graphs also need start + depth + 1: a second best-first over
TreeBuild's table (DraftTreeBuilder.build, one list) started at block_pos[1]. Both are what a TreeBuild that took
`start` and wrote the two position arrays would give in one launch (not in plugins/vocab_nodes.py yet).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ddtree.ops import layers
from ddtree.ops.cuda_tensor import Tensor
from ddtree.runtime.cuda_executor import target_layers
from ddtree.runtime.cuda_step import GpuSteps
from ddtree.tree.sampling import SamplingParams

GREEDY, GUMBEL = "greedy", "gumbel"           # plugins/tree_sample.py's mode names (a step graph's key)
PRIMITIVES_FOR = "top-k / top-p sampling at tp > 1 (the node kernels sample greedy and plain temperature only)"
CANDIDATES = ("topk_values", "topk_ids", "row_max", "row_sumexp")     # layers.draft_head -> layers.tree


def node_sampling(params: SamplingParams, vocab: int) -> str | None:
    """GREEDY or GUMBEL when the node kernels sample `params` as the definition does, None for top-k / top-p."""
    if params.greedy:
        return GREEDY
    if 0 < params.top_k < vocab or params.top_p < 1:
        return None
    return GUMBEL


class NodePlan:
    """What set_params returns (GpuSteps keys its graphs by .mode)."""

    def __init__(self, mode: str):
        self.mode = mode


class TpSteps(GpuSteps):
    def __init__(self, ex):
        super().__init__(ex)
        g, tp = self.gpu, ex.lay.tp
        layouts = getattr(ex, "layouts", None) or [ex.lay]
        self.vocab = int(ex.config.vocab_size)
        self.slice_min = min(lay.vocab_stop - lay.vocab_start for lay in layouts)    # k is the same on every rank
        self.tp = tp
        self.temperature, self.seed = g.zeros((1,), np.float32), g.zeros((2,), np.int32)
        self.no_parent = g.upload(np.array([-1], np.int32))                         # the AR step's one-node tree
        self.position_builders: dict[int, object] = {}                               # depth -> DraftTreeBuilder
        self.primitive_sampling_steps = 0

    def _make_sampler(self):
        return None                          # the node kernels sample (layers.head, layers.accept)

    def set_params(self, params: SamplingParams) -> NodePlan:
        """The temperature and seed into their device buffers (stream-ordered memsets, so after the steps already
        enqueued); the plan's mode keys the graphs. Callers route top-k / top-p to the primitives first."""
        if params != self.params:
            mode = node_sampling(params, self.vocab)
            if mode is None:
                raise ValueError(f"tp {self.tp} step graphs: {params} needs {PRIMITIVES_FOR}")
            from ddtree.plugins.device import _driver, check
            words = [int(np.array(params.temperature, np.float32).view(np.uint32)),
                     params.seed & 0xFFFFFFFF, params.seed >> 32]
            handle = self.gpu.stream.handle
            for address, word in zip((self.temperature.ptr, self.seed.ptr, self.seed.ptr + 4), words):
                check(_driver().cuMemsetD32Async(address, word, 1, handle), "cuMemsetD32Async")
            self.plan, self.params = NodePlan(mode), params
        return self.plan

    def _k(self, budget: int) -> int:
        """Candidates per rank and depth (layers.draft_topk): enough for the budget, the same on every rank."""
        return layers.draft_topk([budget], self.slice_min)

    def graph_ready(self, s, budget: int) -> bool:
        from ddtree.plugins.vocab_nodes import MAX_DEPTH, MAX_LIST_KEYS, slices, tree_capacity
        k, b = self._k(budget), s.block
        return (super().graph_ready(s, budget) and b - 1 <= MAX_DEPTH
                and tree_capacity(b - 1, min(budget, self.tp * k)) >= budget
                and slices(self.slice_min) * k <= MAX_LIST_KEYS and self.tp * k <= MAX_LIST_KEYS)

    # ---- the loop's steps ----------------------------------------------------------------------
    def _answered(self, tokens: list[int]) -> list[int]:
        """The step's tokens, once every peer answered each of its one-shot collectives: a dead or hung peer sets
        its error bit after the bounded spin and the kernels go on with a partial sum, so its tokens are not the
        model's and are never handed on (AllReduceError naming the rank; reading the bits syncs the step); an NCCL
        communicator's asynchronous error likewise (NcclError)."""
        check = getattr(self.ops.collective, "check", None)
        if check is not None:
            check()
        return tokens

    def ar_step(self, s, params: SamplingParams) -> list[int]:
        if node_sampling(params, self.vocab) is not None:
            return self._answered(super().ar_step(s, params))
        from ddtree.runtime.loop import ar_step
        self.drain()
        self.synced = None
        self.primitive_sampling_steps += 1
        return ar_step(self.ex, s, params)

    def ddtree_step(self, s, params: SamplingParams, budget: int) -> list[int]:
        """The graph of (budget, b, mode), or the primitives for top-k / top-p (and --budget auto's table, which
        rank processes refuse before any step)."""
        on_nodes = node_sampling(params, self.vocab) is not None
        if on_nodes and not s.table_k:
            return self._answered(super().ddtree_step(s, params, budget))
        from ddtree.runtime.loop import ddtree_step
        self.drain()
        self._leave_window(s)
        self.primitive_sampling_steps += not on_nodes
        return ddtree_step(self.ex, s, params, budget)

    # ---- the graphs' bodies --------------------------------------------------------------------
    def _winners(self, h: Tensor, sample_pos: Tensor) -> dict:
        """layers.head: this rank's winner (value, id) at every row of h, for the positions sample_pos."""
        out = self.ops.call(layers.head, self.ex.config, feeds={
            "h": h, "sample_pos": sample_pos, "temperature": Tensor.of(self.temperature), "seed": Tensor.of(self.seed)})
        return {"win_value": out["win_value"], "win_id": out["win_id"]}

    def _ar_body(self):
        ex, ops, st = self.ex, self.ops, self.state
        lengths = ex.target_cache.dev.lengths
        st.prologue(2, 0, 0, self.block_ids, self.block_pos, None, lengths, stream=ops.stream)    # pos start, start + 1
        bonus = Tensor.of(self.block_ids.view(0, (1,)))
        feeds = {"ids": bonus, "pos": Tensor.of(self.block_pos.view(0, (1,))), "cache_len": Tensor.of(lengths),
                 "tree_mask": Tensor.of(self.ar_mask)}
        h = target_layers(ex, feeds, ex.target_cache)
        win = self._winners(h, Tensor.of(self.block_pos.view(1, (1,))))
        out = ops.call(layers.accept, feeds={"tokens": bonus, "parents": Tensor.of(self.no_parent), **win})
        st.commit(None, None, None, out["target_tokens"].ptr, stream=ops.stream)

    def _ddtree_body(self, budget: int, b: int, only=None, k: int | None = None):
        """The tp N step's launches by phase (GpuSteps.PHASES; `only`: those phases alone). k (--budget auto's
        table) is tp 1's: its steps never come here."""
        if k or self.forced_accept or self.stated_draft is not None:
            raise NotImplementedError(f"tp {self.tp} step graph: --budget auto and bench step's stated trees are "
                                      "tp 1's")
        ex, ops, d = self.ex, self.ops, self.ex.drafter_config
        kc = self._k(budget)
        v = self.values.setdefault((budget, b), {})
        tree_cfg = d if b == d.block_size else replace(d, block_size=b)            # layers.tree's D = b - 1

        def draft():
            v["cands"] = ops.call(layers.draft_head, d, kc, b, feeds={"h": self._drafter(b)})

        def tree():
            build = self._tree_build(b - 1, kc, budget)
            made = len(ops.kernels)
            root = Tensor(self.state.bonus_ptr, (1,), np.dtype(np.int32), (1,))
            v["tree"] = ops.call(layers.tree, tree_cfg, kc, budget,
                                 feeds={"root": root, **{name: v["cands"][name] for name in CANDIDATES}})
            if len(ops.kernels) != made:
                raise RuntimeError("tp step graph: the cuda backend made its own TreeBuild launcher (its key changed), "
                                   "so the positions this step reads were never written")
            v["pos"] = Tensor.of(build.positions)
            v["sample_pos"] = self._sample_positions(build, b - 1, budget) if self.plan.mode == GUMBEL else v["pos"]

        def verify():
            t = v["tree"]
            feeds = {"ids": t["tokens"], "pos": v["pos"], "cache_len": Tensor.of(ex.target_cache.dev.lengths),
                     "tree_mask": t["visibility"]}
            v["win"] = self._winners(target_layers(ex, feeds, ex.target_cache, self._copy_tap), v["sample_pos"])

        def sample_walk():
            t = v["tree"]
            v["out"] = ops.call(layers.accept, feeds={"tokens": t["tokens"], "parents": t["parents"], **v["win"]})

        def update():
            out = v["out"]
            self._update(b, v["tree"]["tokens"], out["accepted"], out["accepted_count"], out["bonus"], (None, None))

        for name, phase in zip(self.PHASES, (draft, tree, verify, sample_walk, update)):
            if only is None or name in only:
                phase()

    def _tree_build(self, depth: int, k: int, budget: int):
        """The op set's TreeBuild launcher for this shape (the key ops/cuda_backend.py tree_build uses), made here
        with `start` = block_pos[0] so its best-first writes the verify's positions start + depth."""
        from ddtree.plugins.vocab_nodes import TreeBuild
        build = self.ops.launcher(("tree_build", self.tp, depth, k, budget),
                                  lambda: TreeBuild(self.gpu, self.tp, depth, k, budget))
        build.start = self.block_pos.view(0, (1,))
        return build

    def _sample_positions(self, build, depth: int, budget: int) -> Tensor:
        """start + depth + 1 at every node: best-first again over TreeBuild's table (the same tree, one list of
        its K keys per depth) from block_pos[1] = start + 1."""
        from ddtree.plugins.tree_build import DraftTreeBuilder
        if depth not in self.position_builders:
            self.position_builders[depth] = DraftTreeBuilder(self.gpu, vocab=self.vocab, depth=depth,
                                                             max_budget=min(255, self.ops.max_tokens - 1))
        tree = self.position_builders[depth].build(build.table, 1, build.K, self.state.bonus_ptr,
                                                   self.block_pos.view(1, (1,)), budget, stream=self.ops.stream)
        return Tensor.of(tree.positions)

    def last_verify(self) -> dict:
        raise NotImplementedError(f"tp {self.tp} step graph: a rank holds its vocab slice of the logits only "
                                  "(last_verify is tp 1's)")

    def stats(self) -> dict:
        """GpuSteps.stats, and the steps whose sampling ran the primitives (top-k / top-p at tp > 1)."""
        return {**super().stats(), "tp": self.tp, "primitive_sampling_steps": self.primitive_sampling_steps,
                "primitives_for": PRIMITIVES_FOR}
