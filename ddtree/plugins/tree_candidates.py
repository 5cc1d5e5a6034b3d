"""The tree build's candidate table: every node that can be among the B best, known before the drafter runs.

The best-first build (ddtree/tree/build.py build_tree) pops nodes in one total order: path score descending
(the fp32 fold 0 + logp[0][r_1] + ... + logp[d-1][r_d]), then rank tuple ascending (a prefix before its
extensions). Each table row is descending, so every tuple (s_1 .. s_j) with j <= d and s_i <= r_i comes no
later than (r_1 .. r_d) in that order: they are

    need(r) = sum_{j=1..d} prod_{i<=j} (r_i + 1)

distinct nodes, r included. A node among the first B popped therefore has need(r) <= B, whatever the table.
For Kimi's depth 7 that is 6005 tuples at B = 64 (285 at B = 16), and the tree is the B largest keys among
them: one block-wide top-B (kernels/tree_build.cu candidate_select) instead of B pops on one warp.

Table layout (sorted by need, then lexicographically, so the candidates of any B <= cap are a prefix):
    tuple [N] uint64   ranks as bytes r_j + 1, big-endian, zero past the depth (depth <= 8)
    meta  [N] uint32   parent's table index (0xFFFF: the root) | lexicographic rank << 16
numpy twin of the kernel's selection: `candidate_tree` (equal to build_tree; tests/plugins/test_tree_candidates.py).
"""
from __future__ import annotations

import functools
import itertools

import numpy as np

from ddtree.tree.build import Tree

MAX_CANDIDATES = 6144          # TB_MAX_CAND: 12 keys a thread of the 512-thread block
MAX_DEPTH = 8                  # TB_CAND_MAX_DEPTH: one byte per depth in a u64 tuple
ROOT = 0xFFFF


def _tuples(budget: int, depth: int):
    """(ranks, the parent's lexicographic index or -1, need) of every tuple of depth <= `depth` with need <= budget,
    in lexicographic order (a prefix before its extensions)."""
    count = 0

    def walk(prefix: tuple, parent: int, prod: int, total: int):
        nonlocal count
        for r in range(budget):
            p = prod * (r + 1)
            if total + p > budget:
                return
            me, count = count, count + 1
            yield prefix + (r,), parent, total + p
            if len(prefix) + 1 < depth:
                yield from walk(prefix + (r,), me, p, total + p)

    yield from walk((), -1, 1, 0)


def _count(budget: int, depth: int, limit: int) -> int:
    """Tuples of depth <= `depth` with need <= budget, counted up to `limit` + 1."""
    return sum(1 for _ in itertools.islice(_tuples(budget, depth), limit + 1))


@functools.lru_cache(maxsize=None)
def candidate_cap(max_budget: int, depth: int) -> int:
    """The largest budget <= max_budget whose candidates fit the kernel's table (0: none, depth > 8)."""
    if depth > MAX_DEPTH:
        return 0
    lo, hi = 1, max_budget                       # _count(1, .) = 1 always fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _count(mid, depth, MAX_CANDIDATES) <= MAX_CANDIDATES:
            lo = mid
        else:
            hi = mid - 1
    return lo


@functools.lru_cache(maxsize=None)
def candidate_table(cap: int, depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tuple [N] uint64, meta [N] uint32, need [N] int64) for budgets up to `cap`, sorted by (need, lex)."""
    tuples, parents, needs = zip(*_tuples(cap, depth))
    if len(tuples) > MAX_CANDIDATES:
        raise ValueError(f"candidate_table: budget {cap} at depth {depth} has {len(tuples)} candidates, "
                         f"above the kernel's {MAX_CANDIDATES} (candidate_cap gives the largest that fits)")
    order = np.lexsort((np.arange(len(tuples)), np.array(needs)))     # need, then lexicographic
    where = np.empty(len(tuples), np.int64)
    where[order] = np.arange(len(tuples))
    packed = np.zeros(len(tuples), np.uint64)
    meta = np.zeros(len(tuples), np.uint32)
    for i, lex in enumerate(order):
        word = 0
        for j, r in enumerate(tuples[lex]):
            word |= (r + 1) << (8 * (7 - j))
        packed[i] = word
        meta[i] = (ROOT if parents[lex] < 0 else int(where[parents[lex]])) | int(lex) << 16
    need = np.array(needs, np.int64)[order]
    for a in (packed, meta, need):
        a.setflags(write=False)
    return packed, meta, need


def unpack_tuple(word: int) -> tuple:
    ranks = []
    for j in range(MAX_DEPTH):
        byte = (int(word) >> (8 * (7 - j))) & 0xFF
        if byte == 0:
            break
        ranks.append(byte - 1)
    return tuple(ranks)


def candidates_for(cap: int, depth: int, budget: int) -> int:
    """How many table entries (a prefix) a launch at `budget` <= cap reads."""
    return int(np.searchsorted(candidate_table(cap, depth)[2], budget, side="right"))


def candidate_tree(root_token: int, logp: np.ndarray, ids: np.ndarray, budget: int, cap: int | None = None) -> Tree:
    """numpy twin of candidate_select: the B largest (score, -lex) keys among the first candidates_for(cap, D, B)
    entries of the table for `cap` (default: the budget itself) -> build_tree's tree."""
    logp, ids = np.asarray(logp, np.float32), np.asarray(ids)
    D, K = logp.shape
    cap = candidate_cap(budget, D) if cap is None else cap
    if cap < budget:
        raise ValueError(f"candidate_tree: budget {budget} at depth {D} is past the table (cap {cap})")
    packed, meta, _ = candidate_table(cap, D)
    n = candidates_for(cap, D, budget)
    keys = []                                     # (score, lex, index) of the valid candidates
    for i in range(n):
        ranks = unpack_tuple(packed[i])
        if len(ranks) > D or max(ranks) >= K:
            continue
        s = np.float32(0.0)
        for d, r in enumerate(ranks):
            s = np.float32(s + logp[d, r])
        keys.append((s, int(meta[i]) >> 16, i))
    keys.sort(key=lambda k: (-float(k[0]), k[1]))
    tokens, parents, depth, ranks, scores = [int(root_token)], [-1], [0], [()], [np.float32(0.0)]
    node_of = {}
    for s, _, i in keys[:budget]:
        rt, parent = unpack_tuple(packed[i]), int(meta[i]) & 0xFFFF
        node_of[i] = len(tokens)
        tokens.append(int(ids[len(rt) - 1, rt[-1]]))
        parents.append(0 if parent == ROOT else node_of[parent])
        depth.append(len(rt))
        ranks.append(rt)
        scores.append(s)
    return Tree(np.array(tokens, np.int32), np.array(parents, np.int32), np.array(depth, np.int32), ranks,
                np.array(scores, np.float32))
