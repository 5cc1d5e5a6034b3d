"""Launchers for the vocab-parallel sampling and tree nodes (description/nodes.py VocabWinner, VocabTopK, TreeBuild,
AcceptWalk) at any tp: the kernels the cuda backend runs for these ops and a TensorRT plugin's enqueue launches.

    winner = VocabWinner(gpu, vocab=V_r, vocab_start=s)            # workspaces for up to 256 rows
    winner.run(logits, sample_pos, temperature, seed, value, ids, q, stream)
    topk = VocabTopK(gpu, vocab=V_r, k=k, vocab_start=s)
    topk.run(logits, values, ids, row_max, row_sumexp, D, stream)
    build = TreeBuild(gpu, tp=tp, depth=D, k=k, budget=B)
    build.run(root, values, ids, row_max, row_sumexp, tokens, parents, depth, visibility, stream)
    walk = AcceptWalk(gpu, tp=tp)
    walk.run(tokens, parents, win_value, win_id, target, accepted, count, bonus, n, stream)

Each run() is one launch (kernels/sample.cu node_vocab_winner / node_accept_walk, kernels/tree_build.cu
node_vocab_topk / node_tree_build). Every tensor argument is a device address (an int, a DeviceArray, or a
cuda-backend Tensor's .ptr), inputs and outputs alike, so a plugin passes its own buffers; the shapes and
dtypes are the nodes' (description/nodes.py), dense row-major; `stream` is a cuda.core stream, a graph builder, or
None (the Gpu's). The constructor allocates every workspace for its max shapes; run() allocates nothing,
reads no device data on the host and never synchronises, so it can be captured in a CUDA graph. Per-step
scalars (temperature, seed, sample positions, the root) are device buffers the kernels read: greedy (T = 0)
and Gumbel sampling are one kernel, so one graph serves both.

Against backends/numpy_math.py (docs/interfaces.md 6: the GPU may depart from numpy only at near-ties):
  VocabWinner  greedy: ids and values exact. T > 0: the value is the float64 l / T + g (the noise of
               sample_gumbel: Philox, float64 log) rounded to float32, as the backend's upload of numpy's;
               CUDA's float64 log may differ from numpy's in the last bit, so a value may differ by one float32
               ulp and an id only where two tokens' float64 values are that close.
  VocabTopK    values, ids and row_max exact (raw logits; ties -> the lower id). row_sumexp is summed per
               16384-token slice and the slices combined (sliced_sumexp, its numpy twin): within ~1e-6
               relative of numpy's order.
  TreeBuild    the normaliser in numpy's fp32 operations and rank order, with CUDA's expf / logf (within 2 / 1
               ulp of numpy's), then the same fp32 log-probabilities and the best-first build of
               tree_build.cu (bitwise build_tree given one table): the tree equals numpy's unless two candidates'
               (or two paths') scores lie within a few ulps of the normaliser (a near-tie).
  AcceptWalk   exact (float32 and integer compares).
"""
from __future__ import annotations

import math

import numpy as np

from ddtree.plugins.device import Gpu, ptr
from ddtree.plugins.gemm import supports_pdl
from ddtree.plugins.tree_build import CANDIDATES_FROM, CandidateTable
from ddtree.tree.build import MAX_BUDGET

TREE_SOURCE, SAMPLE_SOURCE = "tree_build.cu", "sample.cu"
THREADS = 512                  # TB_THREADS, SP_THREADS
WALK_THREADS = 256             # SP_WALK_THREADS
SLICE = 16384                  # TB_SLICE, SP_SLICE: vocab ids per block
MAX_ROWS = 256                 # rows of one call (the cuda backend's MAX_TOKENS); tree nodes (n <= 256)
MAX_K = 256                    # TB_MAX_K: candidates per row
MAX_LIST_KEYS = 4096           # TB_MAX_LIST_KEYS: keys merged per row (S k, or tp k)
MAX_DEPTH = 16                 # TB_MAX_DEPTH
WINNER_BYTES = 16              # struct Winner { double value; int id; } (padded)


def slices(vocab: int) -> int:
    return math.ceil(vocab / SLICE)


def tree_capacity(depth: int, K: int) -> int:
    """Nodes a best-first tree can reach with K candidates at each of `depth` depths (root excluded)."""
    return sum(K ** d for d in range(1, depth + 1))


def sliced_sumexp(logits) -> tuple[np.ndarray, np.ndarray]:
    """numpy twin of node_vocab_topk's (row_max, row_sumexp) [rows] from logits [rows, V_r]: per 16384-id slice
    (m_s, sum exp(x - m_s)) in fp32, then top = max m_s and sum_s sum_s exp(m_s - top) slice after slice in fp32
    (one slice: its sum as it is). Within a slice the kernel sums in another order (fp32 rounding)."""
    x = np.asarray(logits, np.float32)
    blocks = [x[:, lo: lo + SLICE] for lo in range(0, x.shape[1], SLICE)]
    maxes = [b.max(axis=1) for b in blocks]                                      # [rows] each
    sums = [np.exp(b - m[:, None]).sum(axis=1, dtype=np.float32) for b, m in zip(blocks, maxes)]
    top = np.max(maxes, axis=0)
    if len(blocks) == 1:
        return top, sums[0]
    total = np.zeros_like(top)
    for m, s in zip(maxes, sums):
        total = total + s * np.exp(m - top)                                      # float32 throughout
    return top, total


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


class VocabWinner:
    """The VocabWinner node: logits [q, V_r] float32 of ids vocab_start.. -> value [q] float32, id [q] int32."""

    def __init__(self, gpu: Gpu, vocab: int, vocab_start: int = 0, max_rows: int = MAX_ROWS, pdl: bool | None = None):
        _check(1 <= vocab and 0 <= vocab_start and vocab_start + vocab < 2 ** 31,
               f"VocabWinner: vocab {vocab} from {vocab_start} must be >= 1 ids below 2^31")
        _check(1 <= max_rows <= MAX_ROWS, f"VocabWinner: max_rows must be in 1..{MAX_ROWS}, got {max_rows}")
        self.gpu, self.V, self.start, self.max_rows = gpu, vocab, vocab_start, max_rows
        self.S = slices(vocab)
        self.pdl = supports_pdl(gpu) if pdl is None else pdl
        self.wins = gpu.alloc((max_rows * self.S * WINNER_BYTES,), np.uint8)
        self.row_tickets = gpu.zeros((max_rows,), np.uint32)        # reset by each row's last slice

    def run(self, logits, sample_pos, temperature, seed, value, ids, rows: int, stream=None) -> None:
        """logits [rows, V_r] float32, sample_pos [rows] int32 (the position each sample is for), temperature [1]
        float32 (0: greedy), seed [2] int32 (low word, high word) -> value [rows] float32, ids [rows] int32
        (global). One launch, grid (S, rows)."""
        _check(1 <= rows <= self.max_rows, f"VocabWinner.run: rows {rows} must be in 1..{self.max_rows}")
        g = self.gpu
        g.launch(g.kernel(SAMPLE_SOURCE, "node_vocab_winner"), (self.S, rows, 1), (THREADS, 1, 1), 0,
                 ptr(logits), np.int32(self.V), np.int32(self.start), ptr(sample_pos), ptr(temperature), ptr(seed),
                 ptr(self.wins), ptr(value), ptr(ids), ptr(self.row_tickets), stream=stream, pdl=self.pdl)


class VocabTopK:
    """The VocabTopK node: logits [D, V_r] float32 of ids vocab_start.. -> values [D, k] float32 (raw logits),
    ids [D, k] int32 (global), row_max [D] float32, row_sumexp [D] float32."""

    def __init__(self, gpu: Gpu, vocab: int, k: int, vocab_start: int = 0, max_rows: int = MAX_ROWS,
                 pdl: bool | None = None):
        _check(1 <= vocab and 0 <= vocab_start and vocab_start + vocab < 2 ** 31,
               f"VocabTopK: vocab {vocab} from {vocab_start} must be >= 1 ids below 2^31")
        _check(k >= 1, f"VocabTopK: k must be >= 1, got {k}")
        _check(k <= vocab, f"vocab_topk: k {k} exceeds the rank's {vocab} vocab ids")
        _check(k <= MAX_K, f"VocabTopK: k {k} is above the kernel's {MAX_K}")
        S = slices(vocab)
        _check(S * k <= MAX_LIST_KEYS, f"VocabTopK: vocab {vocab} ({S} slices of {SLICE}) x k {k} = {S * k} keys "
                                       f"per row, above the {MAX_LIST_KEYS} merged per row (lower k)")
        _check(1 <= max_rows <= MAX_ROWS, f"VocabTopK: max_rows must be in 1..{MAX_ROWS}, got {max_rows}")
        self.gpu, self.V, self.k, self.start, self.max_rows, self.S = gpu, vocab, k, vocab_start, max_rows, S
        self.pdl = supports_pdl(gpu) if pdl is None else pdl
        self.parts = gpu.alloc((max_rows * S, 2), np.float32)
        self.lists = gpu.alloc((max_rows * S * k,), np.uint64)
        self.row_tickets = gpu.zeros((max_rows,), np.uint32)

    def run(self, logits, values, ids, row_max, row_sumexp, rows: int, stream=None) -> None:
        """logits [rows, V_r] float32 -> values [rows, k], ids [rows, k], row_max [rows], row_sumexp [rows].
        One launch, grid (S, rows)."""
        _check(1 <= rows <= self.max_rows, f"VocabTopK.run: rows {rows} must be in 1..{self.max_rows}")
        g = self.gpu
        g.launch(g.kernel(TREE_SOURCE, "node_vocab_topk"), (self.S, rows, 1), (THREADS, 1, 1), 0,
                 ptr(logits), np.int32(self.V), np.int32(self.start), np.int32(self.k), ptr(self.parts),
                 ptr(self.lists), ptr(values), ptr(ids), ptr(row_max), ptr(row_sumexp), ptr(self.row_tickets),
                 stream=stream, pdl=self.pdl)


class TreeBuild:
    """The TreeBuild node: the gathered values / ids [tp, D, k] and row_max / row_sumexp [tp, D] -> tokens,
    parents, depth [B + 1] int32 and visibility [B + 1, ceil((B + 1) / 32)] int32 bits (tree/build.py)."""

    def __init__(self, gpu: Gpu, tp: int, depth: int, k: int, budget: int, pdl: bool | None = None):
        _check(1 <= depth <= MAX_DEPTH, f"TreeBuild: depth must be in 1..{MAX_DEPTH}, got {depth}")
        _check(1 <= budget <= MAX_BUDGET, f"TreeBuild: budget must be in 1..{MAX_BUDGET}, got {budget}")
        _check(tp >= 1 and 1 <= k and tp * k <= MAX_LIST_KEYS,
               f"TreeBuild: tp {tp} x k {k} candidates per depth must be 1..{MAX_LIST_KEYS}")
        self.gpu, self.tp, self.D, self.k, self.budget = gpu, tp, depth, k, budget
        self.K = min(budget, tp * k)                       # the table's candidates per depth
        reach = tree_capacity(depth, self.K)
        _check(reach >= budget, f"tree_build: only {reach} candidates for a budget of {budget}")
        self.pdl = supports_pdl(gpu) if pdl is None else pdl
        n = budget + 1
        self.table = gpu.alloc((depth * self.K,), np.uint64)
        self.table_logp = gpu.alloc((depth, self.K), np.float32)   # the table, decoded (for inspection)
        self.table_ids = gpu.alloc((depth, self.K), np.int32)
        self.positions = gpu.alloc((n,), np.int32)                 # best_first's other outputs (unused here)
        self.scores = gpu.alloc((n,), np.float32)
        self.count = gpu.alloc((1,), np.int32)
        self.start = gpu.zeros((1,), np.int32)
        self.done_ticket = gpu.zeros((1,), np.uint32)
        self.candidates = CandidateTable(gpu, depth, budget, CANDIDATES_FROM)   # the block-wide top-B where it pays

    def run(self, root, values, ids, row_max, row_sumexp, tokens, parents, depth, visibility, stream=None) -> None:
        """root [1] int32, values [tp, D, k] float32, ids [tp, D, k] int32, row_max / row_sumexp [tp, D] float32
        -> tokens / parents / depth [B + 1] int32, visibility [B + 1, W] int32. One launch, grid D."""
        g = self.gpu
        g.launch(g.kernel(TREE_SOURCE, "node_tree_build"), (self.D, 1, 1), (THREADS, 1, 1), 0,
                 ptr(values), ptr(ids), ptr(row_max), ptr(row_sumexp), np.int32(self.tp), np.int32(self.k),
                 np.int32(self.K), ptr(root), ptr(self.start), np.int32(self.budget), ptr(self.table),
                 ptr(self.table_logp), ptr(self.table_ids), ptr(tokens), ptr(parents), ptr(depth),
                 ptr(self.positions), ptr(self.scores), ptr(visibility), ptr(self.count), ptr(None),
                 ptr(self.done_ticket), *self.candidates.args(self.budget), stream=stream, pdl=self.pdl)


class AcceptWalk:
    """The AcceptWalk node: tokens / parents [n] int32 and the gathered win_value [tp, n] float32 / win_id
    [tp, n] int32 -> target [n] int32, accepted [n] int32 (-1 after the path), count [1], bonus [1]."""

    def __init__(self, gpu: Gpu, tp: int, max_nodes: int = MAX_ROWS, pdl: bool | None = None):
        _check(tp >= 1, f"AcceptWalk: tp must be >= 1, got {tp}")
        _check(1 <= max_nodes <= MAX_ROWS, f"AcceptWalk: max_nodes must be in 1..{MAX_ROWS}, got {max_nodes}")
        self.gpu, self.tp, self.max_nodes = gpu, tp, max_nodes
        self.pdl = supports_pdl(gpu) if pdl is None else pdl

    def run(self, tokens, parents, win_value, win_id, target, accepted, count, bonus, n: int, stream=None) -> None:
        """One launch of one block (no workspace)."""
        _check(1 <= n <= self.max_nodes, f"AcceptWalk.run: n {n} must be in 1..{self.max_nodes}")
        g = self.gpu
        g.launch(g.kernel(SAMPLE_SOURCE, "node_accept_walk"), (1, 1, 1), (WALK_THREADS, 1, 1), 0,
                 ptr(tokens), ptr(parents), ptr(win_value), ptr(win_id), np.int32(self.tp), np.int32(n),
                 ptr(target), ptr(accepted), ptr(count), ptr(bonus), stream=stream, pdl=self.pdl)
