"""Launcher for the GPU tree build (kernels/tree_build.cu): drafter logits [D, V] -> DDTree tensors.

    builder = DraftTreeBuilder(gpu, vocab=V, depth=D)            # workspaces for budgets up to 255
    tree = builder.run(logits, root, start, budget)              # two launches, no host round trip
    tree.tokens, tree.parents, tree.depth, tree.positions, tree.vis, tree.count   (DeviceArrays)

The tree itself is one block-wide top-B over the candidate table of plugins/tree_candidates.py where the
budget's candidates fit it (depth <= 8; at Kimi's depth 7 budgets up to 64) and it is the faster (from
CANDIDATES_FROM), else B pops on one warp: the same tree either way (`candidates=True / False` force one, for
tests and A/B benches).

Identical to ddtree/tree/build.py (`topk_logprobs` then `build_tree` with k = min(B, V)) in the nodes,
their order, tie rules and fp32 scores, given the same [D, k] table; the table itself (log-softmax and
top-k from raw logits) agrees with numpy within fp32 rounding of the normaliser (docs/interfaces.md 4).
`root` (the bonus token) and `start` (the committed length) are device int32 scalars, so a captured
graph serves every step. run() only launches: it can be captured in a CUDA graph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddtree.plugins.device import DeviceArray, Gpu, ptr
from ddtree.plugins.gemm import supports_pdl
from ddtree.plugins.tree_candidates import candidate_cap, candidate_table, candidates_for
from ddtree.tree.build import MAX_BUDGET

SOURCE = "tree_build.cu"
THREADS = 512
SLICE = 16384                 # TB_SLICE: tokens per block of the two slice kernels
MAX_DEPTH = 16                # TB_MAX_DEPTH: one byte per depth in the packed rank tuple
MAX_LIST_KEYS = 4096          # TB_MAX_LIST_KEYS: S * K keys of one row, merged in registers
STATUS_NAN_DRAFT = 1


def vis_words(nodes: int) -> int:
    return (nodes + 31) // 32


@dataclass
class DeviceTree:
    """Tree tensors of docs/interfaces.md section 4 on the device, n = budget + 1 rows."""
    tokens: DeviceArray       # [n] int32, root first; -1 past `count`
    parents: DeviceArray      # [n] int32, root -1
    depth: DeviceArray        # [n] int32
    positions: DeviceArray    # [n] int32 start + depth
    scores: DeviceArray       # [n] float32 path log-probabilities (root 0)
    vis: DeviceArray          # [n, W] uint32 ancestor-or-self bits
    count: DeviceArray        # [1] int32 nodes built (n unless D * K < budget)
    table_logp: DeviceArray   # [D, K] float32 per-depth top-K log-probabilities, descending
    table_ids: DeviceArray    # [D, K] int32 their token ids

    def numpy(self) -> dict:
        return {name: getattr(self, name).numpy() for name in self.__dataclass_fields__}


def table_keys(logp: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """numpy twin of the kernels' keys (kernels/select.cuh pack_key): u64 = order32(logp) << 32 | ~id, so
    a larger key is a larger log-probability, then a lower id. [..., K] float32, int -> [..., K] uint64."""
    bits = (np.asarray(logp, np.float32) + np.float32(0)).view(np.uint32)          # -0 -> +0
    hi = np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000)).astype(np.uint64)
    return (hi << np.uint64(32)) | (np.uint64(0xFFFFFFFF) - np.asarray(ids).astype(np.uint64))


# Budgets from which the candidate table's top-B beats the pops (H200, `ddtree bench tree --build candidates,pops
# --mode greedy`, V 163840, depth 7, build us: B 12 30.5 / 30.3, B 16 30.5 / 31.8, B 32 34.8 / 38.2, B 64 36.2 /
# 49.3; kernels/NOTES.md "The tree build from a candidate table").
CANDIDATES_FROM = 16


class CandidateTable:
    """The candidate table of budgets from `min_budget` up to `cap` on the device (none past depth 8 or with
    max_budget 0); other budgets build by the pops."""

    def __init__(self, gpu: Gpu, depth: int, max_budget: int, min_budget: int = 1):
        self.depth, self.cap = depth, candidate_cap(max_budget, depth) if max_budget >= min_budget else 0
        self.min_budget = min_budget
        self.tuple = self.meta = None
        if self.cap >= min_budget:
            packed, meta, _ = candidate_table(self.cap, depth)
            self.tuple, self.meta = gpu.upload(packed), gpu.upload(meta)

    def entries(self, budget: int) -> int:
        """Entries a launch at `budget` reads (0: the pops build this tree)."""
        ok = self.tuple is not None and self.min_budget <= budget <= self.cap
        return candidates_for(self.cap, self.depth, budget) if ok else 0

    def args(self, budget: int) -> tuple:
        return ptr(self.tuple), ptr(self.meta), np.int32(self.entries(budget))


class DraftTreeBuilder:
    def __init__(self, gpu: Gpu, vocab: int, depth: int, max_budget: int = MAX_BUDGET, pdl: bool | None = None,
                 candidates: bool | None = None):
        """candidates: None builds budgets from CANDIDATES_FROM by the candidate table where it fits, True every
        budget it fits, False none (the pops always)."""
        if not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"DraftTreeBuilder: depth (drafter block size - 1) must be in 1..{MAX_DEPTH}, got {depth}")
        if not 1 <= max_budget <= MAX_BUDGET:
            raise ValueError(f"DraftTreeBuilder: max_budget must be in 1..{MAX_BUDGET}, got {max_budget}")
        if not 1 <= vocab < 2 ** 31:
            raise ValueError(f"DraftTreeBuilder: vocab must be in 1..2^31-1, got {vocab}")
        self.gpu, self.V, self.D, self.max_budget = gpu, vocab, depth, max_budget
        self.S = math.ceil(vocab / SLICE)
        self.pdl = supports_pdl(gpu) if pdl is None else pdl
        k_max, n_max = min(max_budget, vocab), max_budget + 1
        if self.S * k_max > MAX_LIST_KEYS:
            raise ValueError(f"DraftTreeBuilder: vocab {vocab} needs {self.S} slices of {SLICE}; with {k_max} "
                             f"candidates per depth that is {self.S * k_max} keys per row, above the "
                             f"{MAX_LIST_KEYS} merged per row (lower max_budget)")
        self.parts = gpu.alloc((depth, self.S, 2), np.float32)
        self.lists = gpu.alloc((depth * self.S * k_max,), np.uint64)
        self.table = gpu.alloc((depth * k_max,), np.uint64)
        self.row_tickets = gpu.zeros((depth,), np.uint32)   # reset by the kernels' last arrivals
        self.done_ticket = gpu.zeros((1,), np.uint32)
        self.status = gpu.zeros((1,), np.int32)
        self._out = {name: gpu.alloc((n_max,), dtype) for name, dtype in
                     (("tokens", np.int32), ("parents", np.int32), ("depth", np.int32), ("positions", np.int32),
                      ("scores", np.float32))}
        self._vis = gpu.alloc((n_max * vis_words(n_max),), np.uint32)
        self._count = gpu.alloc((1,), np.int32)
        self._table = (gpu.alloc((depth * k_max,), np.float32), gpu.alloc((depth * k_max,), np.int32))
        self.candidates = CandidateTable(gpu, depth, max_budget if candidates is not False else 0,
                                         CANDIDATES_FROM if candidates is None else 1)

    def outputs(self, budget: int, K: int | None = None) -> DeviceTree:
        """Views of the output buffers shaped for `budget` and K candidates per depth (default min(B, V))."""
        n, K = budget + 1, min(budget, self.V) if K is None else K
        o = self._out
        return DeviceTree(*(o[k].view(0, (n,)) for k in ("tokens", "parents", "depth", "positions", "scores")),
                          self._vis.view(0, (n, vis_words(n))), self._count,
                          self._table[0].view(0, (self.D, K)), self._table[1].view(0, (self.D, K)))

    def run(self, logits: DeviceArray, root: DeviceArray, start: DeviceArray, budget: int, stream=None,
            k: int | None = None) -> DeviceTree:
        """logits [D, V] float32 (row d = depth d + 1), root [1] int32, start [1] int32. Two launches.
        k: candidates per depth in the table (default min(budget, V)); a larger k builds the same tree (a
        best-first tree of B nodes never reaches rank B at any depth) and leaves a table that answers every
        budget up to k (--budget auto's expected acceptance)."""
        self._check_budget(budget)
        if tuple(logits.shape) != (self.D, self.V) or np.dtype(logits.dtype) != np.float32:
            raise ValueError(f"DraftTreeBuilder.run: logits must be float32 [{self.D}, {self.V}], "
                             f"got {np.dtype(logits.dtype).name} {list(logits.shape)}")
        K = min(budget, self.V) if k is None else k
        if not min(budget, self.V) <= K <= min(self.max_budget, self.V):
            raise ValueError(f"DraftTreeBuilder.run: k {k} must be in {min(budget, self.V)}..{min(self.max_budget, self.V)}")
        g, S = self.gpu, self.S
        out = self.outputs(budget, K)
        g.launch(g.kernel(SOURCE, "draft_lse_parts"), (S, self.D, 1), (THREADS, 1, 1), 0,
                 ptr(logits), np.int32(self.V), ptr(self.parts), ptr(self.status), stream=stream, pdl=self.pdl)
        g.launch(g.kernel(SOURCE, "draft_topk"), (S, self.D, 1), (THREADS, 1, 1), 0,
                 ptr(logits), np.int32(self.V), ptr(self.parts), np.int32(K), ptr(self.lists),
                 *self._build_args(root, start, budget, out), stream=stream, pdl=self.pdl)
        return out

    def build(self, lists: DeviceArray, S: int, K: int, root: DeviceArray, start: DeviceArray, budget: int,
              stream=None) -> DeviceTree:
        """The tree from S descending key lists per depth, lists [D, S, K] uint64 (table_keys encoding):
        e.g. the gathered top-K of tensor-parallel ranks. Merged to the top K per depth, then built."""
        self._check_budget(budget)
        if not 1 <= K <= min(self.max_budget, self.V) or S * K > MAX_LIST_KEYS \
                or int(np.prod(lists.shape)) < self.D * S * K:
            raise ValueError(f"DraftTreeBuilder.build: need 1 <= K <= {min(self.max_budget, self.V)}, "
                             f"S * K <= {MAX_LIST_KEYS} and lists [{self.D}, {S}, {K}]; got K {K}, S {S}, "
                             f"{int(np.prod(lists.shape))} keys")
        out = self.outputs(budget, K)
        self.gpu.launch(self.gpu.kernel(SOURCE, "draft_merge"), (self.D, 1, 1), (THREADS, 1, 1), 0,
                        ptr(lists), np.int32(S), np.int32(K), *self._build_args(root, start, budget, out),
                        stream=stream, pdl=self.pdl)
        return out

    def _build_args(self, root, start, budget: int, out: DeviceTree) -> tuple:
        return (ptr(root), ptr(start), np.int32(budget), ptr(self.table), ptr(out.table_logp), ptr(out.table_ids),
                ptr(out.tokens), ptr(out.parents), ptr(out.depth), ptr(out.positions), ptr(out.scores),
                ptr(out.vis), ptr(out.count), ptr(self.row_tickets), ptr(self.done_ticket),
                *self.candidates.args(budget))

    def _check_budget(self, budget: int) -> None:
        if not 1 <= budget <= self.max_budget:
            raise ValueError(f"DraftTreeBuilder: budget {budget} must be in 1..{self.max_budget} (max_budget)")

    def check_status(self) -> None:
        """Raise if any run since the last check saw NaN drafter logits (synchronises; outside graphs)."""
        flags = int(self.status.numpy()[0])
        if flags & STATUS_NAN_DRAFT:
            self.gpu.memset(self.status, 0)
            raise ValueError("DraftTreeBuilder: the drafter logits contained NaN (tree tensors are meaningless)")
