"""Budgeted best-first DDTree construction (docs/ddtree.md 2.2; tensors and tie rules: docs/interfaces.md 4).

Input: the drafter's per-depth top-k table, log-probabilities `logp[D, k]` (fp32, descending per
row) with their token ids `ids[D, k]`. A candidate node is a rank tuple (r_1 .. r_d); its path score
is its parent's score + logp[d-1, r_d], added once in fp32. The builder pops the B best prefixes:
  pop the best candidate -> next node index, record its parent;
  push its next sibling (same parent, rank + 1) and its first child (rank 0 one level deeper).
Both moves never raise the score, so pops come in non-increasing score order and the chosen set is
exactly the top-B prefixes, prefix-closed, with parent index < child index.
Heap order: higher score first; equal scores -> lexicographically smaller rank tuple first.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

MAX_BUDGET = 255


@dataclass
class Tree:
    """A built tree of n = 1 + drafted nodes. Node 0 is the root (the bonus token), depth 0."""
    tokens: np.ndarray      # [n] int32  token of each node
    parents: np.ndarray     # [n] int32  parent index, root -1; parents[i] < i
    depth: np.ndarray       # [n] int32  root 0
    ranks: list             # [n] rank tuple of each node (root: ())
    scores: np.ndarray      # [n] float32 path log-probability (root 0)

    @classmethod
    def from_parents(cls, parents, tokens=None) -> "Tree":
        """A tree known only by its parents (parents[i] < i) and tokens (default zeros): depth derived, ranks and
        scores left empty (the walk, visibility and positions need no more)."""
        parents = np.asarray(parents)
        n = len(parents)
        depth = np.zeros(n, np.int32)
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        tokens = np.zeros(n, np.int32) if tokens is None else np.asarray(tokens)
        return cls(tokens, parents, depth, [()] * n, np.zeros(n, np.float32))

    @property
    def size(self) -> int:
        return len(self.tokens)

    def positions(self, start: int) -> np.ndarray:
        """[n] int64: the sequence position each node occupies (siblings share a position)."""
        return start + self.depth.astype(np.int64)

    def visibility_bits(self) -> np.ndarray:
        """[n, ceil(n/32)] uint32: bit j of row i set iff j == i or j is an ancestor of i."""
        return pack_visibility(self.visible())

    def visible(self) -> np.ndarray:
        """[n, n] bool ancestor-or-self mask among the tree nodes."""
        n = self.size
        vis = np.zeros((n, n), dtype=bool)
        for i in range(n):
            if self.parents[i] >= 0:
                vis[i] = vis[self.parents[i]]
            vis[i, i] = True
        return vis

    def children(self) -> list[dict[int, int]]:
        """Per node: token -> child index (siblings hold distinct tokens: distinct top-k ranks)."""
        kids: list[dict[int, int]] = [{} for _ in range(self.size)]
        for i in range(1, self.size):
            kids[self.parents[i]][int(self.tokens[i])] = i
        return kids


def pack_visibility(vis: np.ndarray) -> np.ndarray:
    """[n, n] bool -> [n, ceil(n/32)] uint32, bit j of row i is (words[i][j >> 5] >> (j & 31)) & 1."""
    n = vis.shape[0]
    words = np.zeros((n, (n + 31) // 32), dtype=np.uint32)
    for j in range(n):
        words[:, j >> 5] |= vis[:, j].astype(np.uint32) << np.uint32(j & 31)
    return words


def unpack_visibility(words: np.ndarray, n: int) -> np.ndarray:
    j = np.arange(n)
    return ((words[:, j >> 5] >> (j & 31).astype(np.uint32)) & 1).astype(bool)


def build_tree(root_token: int, logp: np.ndarray, ids: np.ndarray, budget: int) -> Tree:
    """Best-first top-`budget` prefixes from logp/ids [D, k]. Fewer nodes only if D*k... is exhausted."""
    logp = np.asarray(logp, dtype=np.float32)
    ids = np.asarray(ids)
    if logp.ndim != 2 or logp.shape != ids.shape:
        raise ValueError(f"build_tree: logp {logp.shape} and ids {ids.shape} must be the same [D, k]")
    if not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"build_tree: budget {budget} must be in 1..{MAX_BUDGET}")
    D, k = logp.shape
    tokens, parents, depth, ranks, scores = [int(root_token)], [-1], [0], [()], [np.float32(0.0)]
    if D == 0 or k == 0:
        return _tree(tokens, parents, depth, ranks, scores)
    # heap entry: (-score, rank tuple, parent index, parent score); score = parent score + logp, in fp32
    first = np.float32(np.float32(0.0) + logp[0, 0])
    heap = [(-float(first), (0,), 0, np.float32(0.0))]
    while heap and len(tokens) <= budget:
        neg, rt, parent, parent_score = heapq.heappop(heap)
        d, r = len(rt), rt[-1]
        node = len(tokens)
        score = np.float32(-neg)
        tokens.append(int(ids[d - 1, r]))
        parents.append(parent)
        depth.append(d)
        ranks.append(rt)
        scores.append(score)
        if r + 1 < k:                                      # next sibling: same parent, next rank
            s = np.float32(parent_score + logp[d - 1, r + 1])
            heapq.heappush(heap, (-float(s), rt[:-1] + (r + 1,), parent, parent_score))
        if d < D:                                          # first child: rank 0 one level deeper
            s = np.float32(score + logp[d, 0])
            heapq.heappush(heap, (-float(s), rt + (0,), node, score))
    return _tree(tokens, parents, depth, ranks, scores)


def _tree(tokens, parents, depth, ranks, scores) -> Tree:
    return Tree(np.array(tokens, np.int32), np.array(parents, np.int32), np.array(depth, np.int32),
                ranks, np.array(scores, np.float32))


def topk_logprobs(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """logits [D, V] -> (log-softmax top-k [D, k] fp32 descending, ids [D, k] int32); ties -> lower id."""
    x = np.asarray(logits, dtype=np.float32)
    m = x.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=1, keepdims=True, dtype=np.float32))
    logp = (x - lse).astype(np.float32)                                    # [D, V]
    k = min(k, x.shape[1])
    order = np.lexsort((np.broadcast_to(np.arange(x.shape[1]), x.shape), -logp), axis=1)[:, :k]
    return np.take_along_axis(logp, order, axis=1), order.astype(np.int32)
