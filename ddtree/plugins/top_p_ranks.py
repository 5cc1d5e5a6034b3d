"""numpy twin of top-p sampling over a vocab split across tp ranks, the protocol the GPU kernels are to follow (issue
23: top-p gather across ranks). It decides exactly what one rank holding the whole row decides (plugins/top_p_bins.py
row_cut, sample_top_p) while no rank ever sees another rank's logits:

    1. all-reduce max of the ranks' row maxima -> l_top (float32: exact in any order)
    2. each rank: token_fixed of its slice against l_top -> per-bin integer masses [BINS] int64
    3. all-reduce sum of those integers (exact in any order: every rank holds the single-rank row's bin masses)
       -> norm, the crossing bin b*, the mass above it and the error bounds, identical on every rank
    4. all-gather of the crossing bin's tokens (logit, global id, F): at most MAX_BIN_KEYS in all, else the bin is
       kept whole and flagged, as on one rank
    5. every rank orders them by key (logit desc, id asc), finds the cut and certifies it, as row_cut does
    6. each rank keeps bins < b* and its crossing-bin tokens up to the cut key, draws the Gumbel winner over them
       (value, global id), and the winners merge as VocabWinner's do (larger value, then lower id)
Per row the exchanges are a float32 max, BINS int64 sums (32 KB: the dominant one; a kernel may send only the
nonzero bins or a cumulative prefix), the crossing bin's few tokens and a (value, id) winner.

The GPU side: kernels/sample_top_p_ranks.cu, launcher plugins/top_p_ranks_gpu.py (TopPRanks). It gathers the bins
whole (4096 u64 a row, summed in rank order after the all-gather) and the crossing bin's tokens with the winners in
one fixed-size record a row (MAX_BIN_KEYS keys a rank), so its exchanges can be captured in a graph; step 6's
winners travel in that record, and every rank merges them with the Gumbel winner of the cut's kept prefix, which
every rank computes from the gathered keys (the same maximum as merging each rank's winner over its kept set).
tests/plugins/test_top_p_ranks_gpu.py checks its tokens and flags against ranks_sample_top_p.
"""
from __future__ import annotations

import numpy as np

from ddtree.plugins.top_p_bins import (BIN_OVERFLOW, BINS, FIXED_BITS, INEXACT, MAX_BIN_KEYS, F32, bin_errors,
                                       bin_scales, certify, inv_t_pair, order_tie, token_fixed)


def ranks_kept(slices: list[np.ndarray], offsets: list[int], temperature: float, top_p: float):
    """The ranks' slices [V_r] of one row -> (kept masks per rank [V_r] bool, flags): steps 1-6's decision."""
    slices = [np.asarray(s, F32) for s in slices]
    V = sum(s.size for s in slices)
    ih, il = inv_t_pair(temperature)
    l_top = F32(max(np.max(s) for s in slices))                                   # 1. all-reduce max
    fixed_r, bins_r, F_r = [], [], []
    for s in slices:                                                              # 2. per rank
        bins, F = token_fixed(s, l_top, ih, il)
        part = np.zeros(BINS, np.int64)
        np.add.at(part, bins, F)
        fixed_r.append(part), bins_r.append(bins), F_r.append(F)
    fixed = np.sum(fixed_r, axis=0)                                               # 3. all-reduce sum (exact)
    scales = bin_scales()
    mass = scales * (fixed.astype(np.float64) * 2.0 ** -FIXED_BITS)
    norm = float(np.sum(mass))
    target = top_p * norm
    before = np.concatenate([[0.0], np.cumsum(mass)[:-1]])
    crossing = np.flatnonzero((mass > 0) & (before + mass >= target))
    b = int(crossing[0]) if crossing.size else int(np.flatnonzero(mass > 0)[-1])
    err = bin_errors(mass, scales, V)
    kept = [bins < b for bins in bins_r]
    members = [np.flatnonzero(bins == b) for bins in bins_r]                      # 4. all-gather of bin b's tokens
    if sum(m.size for m in members) > MAX_BIN_KEYS:
        for k, m in zip(kept, members):
            k[m] = True
        return kept, BIN_OVERFLOW
    logit = np.concatenate([s[m] for s, m in zip(slices, members)])
    ids = np.concatenate([o + m for o, m in zip(offsets, members)])
    F = np.concatenate([f[m] for f, m in zip(F_r, members)])
    order = np.lexsort((ids, -logit.astype(np.float64)))                          # 5. key order, the cut
    prefix = np.cumsum(F[order])
    A = float(before[b]) + scales[b] * (prefix.astype(np.float64) * 2.0 ** -FIXED_BITS)
    reached = np.flatnonzero(A >= target)
    cut = int(reached[0]) if reached.size else order.size - 1
    certified = certify(float(before[b]), norm, float(err[:b].sum()), float(err[b + 1:].sum()), scales[b], b,
                        prefix, cut, top_p, V, float(l_top) / temperature)
    tie = order_tie(logit, order, cut, temperature, float(l_top) / temperature)
    cut_ids = set(ids[order[: cut + 1]].tolist())
    for k, m, o in zip(kept, members, offsets):                                   # 6. each rank's kept set
        k[m] = np.isin(o + m, list(cut_ids))
    return kept, 0 if certified and not tie else INEXACT


def ranks_sample_top_p(slices: list[np.ndarray], offsets: list[int], positions, temperature: float, top_p: float,
                       seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The ranks' logits slices [n, V_r] -> (tokens [n], flags [n]): each rank's Gumbel winner over its kept set,
    merged (larger value, then lower id)."""
    from ddtree.tree.sampling import gumbel
    positions = np.asarray(positions, np.int64).reshape(-1)
    n = len(slices[0])
    tokens, flags = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for i in range(n):
        kept, flags[i] = ranks_kept([s[i] for s in slices], offsets, temperature, top_p)
        best = None
        for s, o, k in zip(slices, offsets, kept):
            ids = o + np.flatnonzero(k)
            if ids.size == 0:
                continue
            noisy = np.asarray(s[i], F32)[ids - o].astype(np.float64) / temperature + gumbel(seed, positions[i], ids)
            j = int(np.argmax(noisy))
            win = (float(noisy[j]), -int(ids[j]))
            best = win if best is None or win > best else best
        tokens[i] = -best[1]
    return tokens, flags
