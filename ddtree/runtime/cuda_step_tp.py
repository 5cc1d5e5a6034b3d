"""The DDTree and AR step graphs of one rank of a tp > 1 engine (runtime/ranks.py RankProcesses(cuda=...)): each
rank process captures its own graphs, with the collectives inside them, and replays one graph per step, as tp 1
does (runtime/cuda_step.py, whose capture, pipelining, record ring and window this class inherits).

    steps = TpSteps(ex)          # ex: CudaExecutor(rank=r) whose collective is capturable (ProcessRankMember)

A DDTree step graph at tp N, written over the op set's layer functions (description/layers.py) like the model itself:
    draft        the prologue, draft_fc, the drafter layers (tp 1's), then layers.draft_head: this rank's top-k
                 candidates [D, k] of its vocab slice and its row max / sum-exp parts (VocabTopK)
    tree         layers.tree: the candidates all-gathered [tp, D, k] -> TreeBuild: the ranks' normaliser and the
                 best-first tree (tokens, parents, depth, visibility); its positions start + depth (below)
    verify       embed + every decoder layer over the tree, taps copied; layers.head: this rank's sampling winner
                 at every node (VocabWinner: greedy, or Gumbel at the temperature on the device) for the
                 position start + depth + 1 (top-p: layers.head_logits, this rank's logits slice [n, V_r])
    sample+walk  layers.accept: the winners all-gathered [tp, n] -> the target token at every node, the walk
                 (top-p: TopPRanks over the slices -> the same global token at every node on every rank, then
                 accept_sampled: the walk over them, AcceptWalk with one "rank" holding them)
    update       compaction, the context window, the record and the state (tp 1's)
The AR step graph: the prologue, embed + layers over the bonus token, layers.head at start + 1, layers.accept
over the one-node tree [bonus] (its target token is the sample), the commit (top-p: head_logits, TopPRanks' one
row committed as it is).

Lockstep. The one-shot collectives number their calls on the device (parallel/cuda_collectives.py ProcessRankMember),
so every rank must launch the same collectives in the same order: every rank runs the same loop under the same
control records (runtime/ranks.py), and every choice here (graph or primitives, the graph's key, the step
enqueued ahead, the first eager run and the captures) is a function of the state all ranks share.

Sampling. The node kernels sample greedy and plain temperature (Gumbel-max over l / T). Top-p without top-k
runs TopPRanks (plugins/top_p_ranks_gpu.py: five kernels around three all-gathers through the rank's collective,
inside the graph), whose tokens and flags are those one GPU holding the whole row would give (TreeSampler); a
step whose record carries its INEXACT / BIN_OVERFLOW flags raises naming the step and rows, as tp 1's
check_status does, unless allow_inexact. Top-k (with or without top-p) would need the ranks' top-k merged (not
written), so such a step runs the primitives (runtime/loop.py: the logits slices gathered through the host group,
the host's sampler: the definition exactly, no graph); stats() counts those steps. VocabWinner reads T as
float32 (T = 0.8 is 0.8 + 1.2e-8): a token can differ from the float64 definition's only where two z + g are
within that relative 1e-8 (the GPU logits' own error is far larger).

Positions. TreeBuild's best-first writes start + depth into its `positions` workspace from its `start` buffer (a
zero by default): the op set's launcher is made here with `start` = block_pos[0] (the prologue's start), so its
workspace holds the verify's positions. The sampled graphs also need start + depth + 1: a second best-first over
TreeBuild's table (DraftTreeBuilder.build, one list) started at block_pos[1]. Both are what a TreeBuild that took
`start` and wrote the two position arrays would give in one launch (not in plugins/vocab_nodes.py yet).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ddtree.backends.cuda_tensor import Tensor
from ddtree.description import layers
from ddtree.description.opset import F32, I32
from ddtree.plugins.device import set_words
from ddtree.plugins.top_p_ranks_gpu import KERNELS, SOURCE, TopPRanks
from ddtree.plugins.tree_build import DraftTreeBuilder
from ddtree.plugins.tree_sample import STATUS_BIN_OVERFLOW, STATUS_INEXACT
from ddtree.plugins.vocab_nodes import MAX_DEPTH, MAX_LIST_KEYS, TreeBuild, slices, tree_capacity
from ddtree.runtime import loop
from ddtree.runtime.cuda_model import target_layers
from ddtree.runtime.cuda_step import GpuSteps, _array
from ddtree.tree.sampling import SamplingParams

GREEDY, GUMBEL, TOP_P = "greedy", "gumbel", "top_p"   # plugins/tree_sample.py's mode names (a step graph's key)
PRIMITIVES_FOR = ("top-k sampling at tp > 1 (the node kernels sample greedy and plain temperature, TopPRanks top-p "
                  "without top-k)")
CANDIDATES = ("topk_values", "topk_ids", "row_max", "row_sumexp")     # layers.draft_head -> layers.tree


def node_sampling(params: SamplingParams, vocab: int) -> str | None:
    """GREEDY or GUMBEL when the node kernels sample `params` as the definition does, TOP_P for top-p without
    top-k (TopPRanks), None for top-k (the primitives)."""
    if params.greedy:
        return GREEDY
    if 0 < params.top_k < vocab:
        return None
    return TOP_P if params.top_p < 1 else GUMBEL


def accept_sampled(ops) -> None:
    """layers.accept for target tokens every rank already holds (TopPRanks'): the walk over them, through the op
    set's accept_walk with one \"rank\" whose winners are those tokens (its values unread: nothing to merge)."""
    tokens, parents = ops.input("tokens", ["nodes"], I32), ops.input("parents", ["nodes"], I32)
    target, accepted, count, bonus = ops.accept_walk(tokens, parents, ops.input("win_value", [1, "nodes"], F32),
                                                     ops.input("win_id", [1, "nodes"], I32))
    ops.output("target_tokens", target, ["nodes"], I32)
    ops.output("accepted", accepted, ["nodes"], I32)
    ops.output("accepted_count", count, [1], I32)
    ops.output("bonus", bonus, [1], I32)


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
        self.top_p = self.no_values = None       # TopPRanks and a [max_tokens] zero row, made on first top-p
        self.allow_inexact = False               # a flagged top-p row raises (no request asks otherwise, as tp 1)

    def _make_sampler(self):
        return None                          # the node kernels sample (layers.head, layers.accept)

    def set_params(self, params: SamplingParams) -> NodePlan:
        """The temperature and seed into their device buffers (top-p: TopPRanks' parameter record), stream-ordered
        memsets, so after the steps already enqueued; the plan's mode keys the graphs. Callers route top-k to the
        primitives first."""
        if params != self.params:
            mode = node_sampling(params, self.vocab)
            if mode is None:
                raise ValueError(f"tp {self.tp} step graphs: {params} needs {PRIMITIVES_FOR}")
            if mode == TOP_P:
                self._top_p().set_params(params, stream=self.gpu.stream)
                self.plan, self.params = NodePlan(mode), params
                return self.plan
            set_words(self.temperature.ptr, [np.array(params.temperature, np.float32).view(np.uint32)], self.gpu.stream)
            set_words(self.seed.ptr, [params.seed & 0xFFFFFFFF, params.seed >> 32], self.gpu.stream)
            self.plan, self.params = NodePlan(mode), params
        return self.plan

    def _top_p(self):
        """TopPRanks over this rank's slice for up to max_tokens rows, its all-gathers through the op set's
        collective (cuda_ranks.py sizes the one-shot for its largest part). Its kernels are loaded (compiled if
        not cached) here, not between the step's collectives, where a peer waits a bounded ~1 s."""
        if self.top_p is None:
            lay, g = self.ex.lay, self.gpu
            self.top_p = TopPRanks(g, self.ops.collective, ranks=self.tp, vocab=self.vocab,
                                   slice_vocab=lay.vocab_stop - lay.vocab_start, max_rows=self.ops.max_tokens)
            self.no_values = g.zeros((self.ops.max_tokens,), np.float32)
            for name in KERNELS:
                g.kernel(SOURCE, name)
        return self.top_p

    def _sampled(self, logits: Tensor, query_pos, n: int):
        """TopPRanks at every row of this rank's logits [n, V_r] for the positions query_pos + 1 -> RanksOutputs
        (tokens [n] global ids, flags [n]: the same on every rank)."""
        return self.top_p.launch(_array(self.gpu, logits), self.ex.lay.vocab_start, query_pos, n,
                                 stream=self.ops.stream)

    def _k(self, budget: int) -> int:
        """Candidates per rank and depth (layers.draft_topk): enough for the budget, the same on every rank."""
        return layers.draft_topk([budget], self.slice_min)

    def graph_ready(self, s, budget: int) -> bool:
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

    def _step(self, key: tuple, body, prepare, ahead: bool) -> dict:
        """GpuSteps._step, then a top-p step's flags: its record carries TopPRanks' status word, as tp 1's carries
        the sampler's (checked there by TreeSampler.check_status)."""
        step = self.state.steps + 1
        rec = super()._step(key, body, prepare, ahead)
        if rec["status"] and self.top_p is not None:
            self._check_top_p(key, step, rec, overwritten=self.state.steps > step)
        return rec

    def _check_top_p(self, key: tuple, step: int, rec: dict, overwritten: bool) -> None:
        """NaN logits or a wrong record raise (TopPRanks.check_status); a row flagged INEXACT / BIN_OVERFLOW raises
        naming the step and the rows unless allow_inexact. overwritten: the next step (enqueued ahead, drained by
        _step) ran after it, so the per-row flags read are that step's."""
        flags = self.top_p.check_status(allow_inexact=True)
        if not flags & (STATUS_INEXACT | STATUS_BIN_OVERFLOW) or self.allow_inexact:
            return
        n = 1 if key[0] == "ar" else key[1] + 1
        rows = np.flatnonzero(self.top_p.out.flags.numpy()[:n]).tolist()
        which = "rows of the step enqueued after it (this step's were overwritten)" if overwritten else "rows"
        kinds = [name for bit, name in ((STATUS_INEXACT, "INEXACT"), (STATUS_BIN_OVERFLOW, "BIN_OVERFLOW"))
                 if flags & bit]
        raise ValueError(f"tp {self.tp} {'AR' if key[0] == 'ar' else 'DDTree'} step {step} (from position "
                         f"{rec['start'] - rec['count']}): a top-p cut is flagged {' | '.join(kinds)} ({which} {rows}; "
                         "INEXACT: within the certified bound of top_p, BIN_OVERFLOW: the crossing bin kept whole), "
                         "so its tokens may not be the definition's")

    def ar_step(self, s, params: SamplingParams) -> list[int]:
        if node_sampling(params, self.vocab) is not None:
            return self._answered(super().ar_step(s, params))
        self.drain()
        self.synced = None
        self.primitive_sampling_steps += 1
        return loop.ar_step(self.ex, s, params)

    def ddtree_step(self, s, params: SamplingParams, budget: int) -> list[int]:
        """The graph of (budget, b, mode), or the primitives for top-k (and --budget auto's table, which rank
        processes refuse before any step)."""
        on_nodes = node_sampling(params, self.vocab) is not None
        if on_nodes and not s.table_k:
            return self._answered(super().ddtree_step(s, params, budget))
        self.drain()
        self._leave_window(s)
        self.primitive_sampling_steps += not on_nodes
        return loop.ddtree_step(self.ex, s, params, budget)

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
        if self.plan.mode == TOP_P:                        # the one row's sample, the same on every rank
            logits = ops.call(layers.head_logits, ex.config, feeds={"h": h})["logits"]
            token = self._sampled(logits, self.block_pos, 1).tokens
            st.commit(None, None, None, token.ptr, status=(self.top_p.status, None), stream=ops.stream)
            return
        win = self._winners(h, Tensor.of(self.block_pos.view(1, (1,))))
        out = ops.call(layers.accept, feeds={"tokens": bonus, "parents": Tensor.of(self.no_parent), **win})
        st.commit(None, None, None, out["target_tokens"].ptr, stream=ops.stream)

    def _ddtree_body(self, budget: int, b: int, only=None, k: int | None = None):
        """The tp N step's launches by phase (GpuSteps.PHASES; `only`: those phases alone). k (--budget auto's
        table) is tp 1's: its steps never come here."""
        if k:
            raise NotImplementedError(f"tp {self.tp} step graph: --budget auto's table is tp 1's")
        ex, ops, d, top_p = self.ex, self.ops, self.ex.drafter_config, self.plan.mode == TOP_P
        kc, n = self._k(budget), budget + 1
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
            h = target_layers(ex, feeds, ex.target_cache, self._copy_tap, self.taps)
            if top_p:
                v["logits"] = ops.call(layers.head_logits, ex.config, feeds={"h": h})["logits"]     # [n, V_r]
            else:
                v["win"] = self._winners(h, v["sample_pos"])

        def sample_walk():
            t = v["tree"]
            if top_p:                    # the nodes' tokens for start + depth + 1, then the walk over them
                tokens = self._sampled(v["logits"], _array(self.gpu, v["pos"]), n).tokens.view(0, (1, n))
                v["out"] = ops.call(accept_sampled, feeds={
                    "tokens": t["tokens"], "parents": t["parents"],
                    "win_value": Tensor.of(self.no_values.view(0, (1, n))), "win_id": Tensor.of(tokens)})
            else:
                v["out"] = ops.call(layers.accept, feeds={"tokens": t["tokens"], "parents": t["parents"], **v["win"]})

        def update():
            out = v["out"]
            status = (self.top_p.status, None) if top_p else (None, None)
            self._update(b, v["tree"]["tokens"], out["accepted"], out["accepted_count"], out["bonus"], status)

        for name, phase in zip(self.PHASES, (draft, tree, verify, sample_walk, update)):
            if only is None or name in only:
                phase()

    def _tree_build(self, depth: int, k: int, budget: int):
        """The op set's TreeBuild launcher for this shape (the key backends/cuda_backend.py tree_build uses), made here
        with `start` = block_pos[0] so its best-first writes the verify's positions start + depth."""
        build = self.ops.launcher(("tree_build", self.tp, depth, k, budget),
                                  lambda: TreeBuild(self.gpu, self.tp, depth, k, budget))
        build.start = self.block_pos.view(0, (1,))
        return build

    def _sample_positions(self, build, depth: int, budget: int) -> Tensor:
        """start + depth + 1 at every node: best-first again over TreeBuild's table (the same tree, one list of
        its K keys per depth) from block_pos[1] = start + 1."""
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
        """GpuSteps.stats, and the steps whose sampling ran the primitives (top-k at tp > 1)."""
        return {**super().stats(), "tp": self.tp, "primitive_sampling_steps": self.primitive_sampling_steps,
                "primitives_for": PRIMITIVES_FOR}
