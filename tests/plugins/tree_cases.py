"""Inputs for the GPU tree tests (test_tree_gpu.py): [D, K] tables and logits with constructed exact ties.

Everything is a pure function of its arguments (numpy PCG64 streams), so the device computes the same
inputs as this machine. Tables are what the builder's contract promises: rows descending, log-probs
<= 0, and within a run of equal log-probs the ids ascending (the top-k tie rule).
"""
from __future__ import annotations

import numpy as np


def table(rng, D: int, K: int, V: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(logp [D, K] float32 descending, ids [D, K] int32 distinct per row) of one kind:
    smooth   -cumsum of exponential gaps (no ties)
    quarter  multiples of 1/4: path scores tie exactly and often (fp32 sums of quarters are exact)
    flat     every entry -1: all siblings tie, order by rank tuple only
    inf      smooth, then -inf past a random point"""
    gaps = rng.exponential(0.7, size=(D, K)).astype(np.float32)
    logp = -np.cumsum(gaps, axis=1, dtype=np.float32)
    if kind == "quarter":
        logp = -np.cumsum(rng.integers(0, 3, size=(D, K)) * 0.25, axis=1).astype(np.float32) - np.float32(0.25)
    elif kind == "flat":
        logp = np.full((D, K), -1.0, np.float32)
    elif kind == "inf":
        for d in range(D):
            logp[d, rng.integers(1, K + 1):] = -np.inf
    ids = np.stack([rng.choice(V, size=K, replace=False) for _ in range(D)]).astype(np.int32)
    for d in range(D):                      # ties: lower id first, as the top-k delivers them
        order = np.lexsort((ids[d], -logp[d]))
        ids[d] = ids[d][order]
    return logp.astype(np.float32), ids


def draft_logits(rng, D: int, V: int, ties: bool) -> np.ndarray:
    """[D, V] float32 drafter-like logits (a few strong tokens over a noisy floor); with ties, the top
    values are repeated at scattered ids so top-k boundaries fall inside runs of equal logits."""
    x = rng.standard_normal((D, V)).astype(np.float32) * 2
    for d in range(D):
        strong = rng.choice(V, size=min(V, 300), replace=False)
        x[d, strong] += rng.uniform(4, 12, size=strong.size).astype(np.float32)
        if ties:
            vals = np.sort(x[d])[::-1][: min(V, 40)]
            for v in vals[::3]:
                dup = rng.choice(V, size=3, replace=False)
                x[d, dup] = v
    return x


def target_logits(rng, n: int, V: int, shape: str, favour=None) -> np.ndarray:
    """[n, V] float32 target logits.
    peaked  a few dominant tokens: top-p needs few candidates (the kernels' certified path)
    flat    standard normal: top-p 0.9 needs ~tens of thousands of tokens (the full-row path)
    ties    peaked, with the 30 largest values of each row repeated at other ids
    favour  optional [n] token ids given a large logit (to steer the walk down the tree; -1 = none)"""
    x = rng.standard_normal((n, V)).astype(np.float32)
    if shape in ("peaked", "ties"):
        x *= 2
        for i in range(n):
            strong = rng.choice(V, size=min(V, 20), replace=False)
            x[i, strong] += rng.uniform(6, 14, size=strong.size).astype(np.float32)
            if shape == "ties":
                for v in np.sort(x[i])[::-1][:30]:
                    x[i, rng.choice(V, size=2, replace=False)] = v
    if favour is not None:
        for i, t in enumerate(favour):
            if t >= 0:
                x[i, t] = x[i].max() + np.float32(3.0)
    return x
