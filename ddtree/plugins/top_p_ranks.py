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

The smaller exchange (ranks_kept_coarse, ranks_sample_top_p_coarse; no kernels yet): steps 2-4 in three fixed-size
all-gathers, so a graph can still hold them. Bytes a rank sends per row and round (coarse_exchange_bytes):

    round 0   row max                                                     4 B
    round 1   its COARSE = 64 float64 partial masses, m_rc = sum over the coarse bin's FINE = 64 bins b, in
              bin order, of s_b F_rb 2^-35; every rank sums the ranks' in rank order -> mass_c, their
              sequential cumulative -> norm and the crossing coarse bin c*                        512 B
    round 2   its 64 integer sums F_rb of c*'s fine bins (exact: the single rank's bins there) -> b*, the
              cumulative above it and the bounds                                                  512 B
    round 3   today's record with a fixed prefix of K = 256 keys: its count in b*, K keys, the winners;
              a rank holding more than K (or all more than MAX_BIN_KEYS) -> b* kept whole, BIN_OVERFLOW   2 096 B
    4 rounds (today 3), 3 124 B a row (today 65 588), 203 KB at n = 65 (today 4.26 MB).
The keys need their own round: which fine bin crosses is known only once round 2's sums are in.

Its bound. The single rank's per-bin bounds (top_p_bins.py) cover |M_b - exact| for the model masses
M_b = s_b F_b 2^-35 in real arithmetic. Coarse bins are known only as sums, so bin c gets the relative bound of its
last (widest-error) fine bin: E_c = (1.02 eps(64 c + 63) + 2^-51) mass_c (1 + 2^-40), plus s_4095 V 2^-16 in the
last coarse bin (the far bin's absolute bound; eps(4094) covers its relative part). c*'s fine bins get the single
rank's own bounds (their integer sums are the single rank's). The float64 rounding against real arithmetic, all
terms nonnegative (gamma_k = k u / (1 - k u), u = 2^-53): a rank's m_rc is 64 products and 63 additions, gamma_64;
the rank-order sum adds gamma_(tp-1): mass_c is within gamma_(63+tp) of its model; norm adds 63 more additions,
the cumulative above b* at most 63 coarse and 64 fine additions and one product a fine bin: both within
gamma_(192+tp) <= 1.01 (192 + tp) u of their models, relative to norm (rounding_eps). err_above gets that once,
err_below twice (certify forms the mass below as norm - A); certify's own 64 u x norm still covers its last
products and sums. A decision the bounds cannot certify is flagged INEXACT; the bits are deterministic on every
rank but not the single rank's and the bounds are looser by about 5e-14 x norm, so a row that close to its
certificate's threshold may be flagged where one rank's is not (a wrong c* fails the certificate: flagged too).
tests/plugins/test_top_p_ranks_coarse.py checks it against row_cut / sample_top_p and the bounds against exact sums.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.plugins.top_p_bins import (
    ARG_EPS,
    BIN_OVERFLOW,
    BIN_SLACK,
    BINS,
    CLAMP,
    CLAMP_EPS,
    F32,
    FIXED_BITS,
    INEXACT,
    MAX_BIN_KEYS,
    TOKEN_EPS,
    U64,
    bin_errors,
    bin_scales,
    certify,
    inv_t_pair,
    mass_prefix,
    order_tie,
    token_fixed,
)
from ddtree.tree.sampling import gumbel


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
    before, norm = mass_prefix(mass)                                              # exactly rounded
    target = top_p * norm
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
    return _sample(ranks_kept, slices, offsets, positions, temperature, top_p, seed)


def _sample(decide, slices, offsets, positions, temperature, top_p, seed) -> tuple[np.ndarray, np.ndarray]:
    """decide(row slices, offsets, temperature, top_p) -> (kept per rank, flags); then the winners' merge."""
    positions = np.asarray(positions, np.int64).reshape(-1)
    n = len(slices[0])
    tokens, flags = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for i in range(n):
        kept, flags[i] = decide([s[i] for s in slices], offsets, temperature, top_p)
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


# The coarse-then-fine exchange (module docstring).
COARSE = 64                    # coarse bins (round 1)
FINE = BINS // COARSE          # fine bins a coarse bin (round 2)
KEYS_PER_RANK = 256            # K: a rank's crossing-bin keys in round 3's record
SCALES = bin_scales()          # [BINS] float64 s_b


def coarse_exchange_bytes(keys_per_rank: int = KEYS_PER_RANK) -> dict[str, int]:
    """Bytes one rank sends per row in each of the coarse protocol's all-gathers, in order."""
    return {"row_max": 4, "coarse": 8 * COARSE, "fine": 8 * FINE, "record": 48 + 8 * keys_per_rank}


def rank_coarse(fixed: np.ndarray) -> np.ndarray:
    """Round 1, one rank: its bin sums [BINS] int64 -> [COARSE] float64, sum of s_b F_b 2^-35 over each coarse
    bin's fine bins in bin order."""
    terms = (SCALES * (fixed.astype(np.float64) * 2.0 ** -FIXED_BITS)).reshape(COARSE, FINE)
    mass = np.zeros(COARSE)
    for j in range(FINE):
        mass = mass + terms[:, j]
    return mass


def rounding_eps(tp: int) -> float:
    """Relative bound (x norm) of norm's and the cumulative's float64 rounding against real arithmetic."""
    return 1.01 * U64 * (2 * COARSE + FINE + tp)


def coarse_errors(mass: np.ndarray, vocab: int) -> np.ndarray:
    """[COARSE] bounds of |model mass of coarse bin c - exact| from the summed coarse masses [COARSE] alone."""
    last = np.minimum(np.arange(COARSE) * FINE + FINE - 1, CLAMP - 1)
    err = (1.02 * (TOKEN_EPS + ARG_EPS * (last + 1) / 128.0) + BIN_SLACK) * mass * (1 + 2.0 ** -40)
    err[-1] += SCALES[CLAMP] * vocab * CLAMP_EPS
    return err


@dataclass
class CoarseDecision:
    coarse_bin: int            # c*
    bin: int                   # b*
    norm: float                # float64, the same on every rank
    above: float               # float64 cumulative mass above b*
    err_above: float           # bound of |above - exact mass above b*|, rounding included
    err_below: float           # bound for the mass below b* (formed as norm - A: rounding twice)
    rounding: float            # rounding_eps(tp) x norm, the float64 part of both


def coarse_crossing(coarse_r: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray, int]:
    """Round 1 gathered [tp, COARSE] -> (mass [COARSE] summed in rank order, its cumulative [COARSE], c*)."""
    mass = np.zeros(COARSE)
    for part in coarse_r:
        mass = mass + part
    cum = np.cumsum(mass)                                                         # sequential
    crossing = np.flatnonzero((mass > 0) & (cum >= top_p * cum[-1]))
    return mass, cum, int(crossing[0]) if crossing.size else int(np.flatnonzero(mass > 0)[-1])


def fine_crossing(mass, cum, c: int, fine_fixed: np.ndarray, top_p: float, vocab: int, tp: int) -> CoarseDecision:
    """Round 2 summed: c*'s fine bin sums [FINE] int64 (exact) -> b*, the cumulative above it and the bounds."""
    norm = float(cum[-1])
    lo = c * FINE
    fine = SCALES[lo: lo + FINE] * (fine_fixed.astype(np.float64) * 2.0 ** -FIXED_BITS)
    run = np.cumsum(np.concatenate([[float(cum[c - 1]) if c else 0.0], fine]))    # run[j]: mass above lo + j
    crossing = np.flatnonzero((fine > 0) & (run[1:] >= top_p * norm))
    j = int(crossing[0]) if crossing.size else int(np.flatnonzero(fine > 0)[-1])
    whole = np.zeros(BINS)
    whole[lo: lo + FINE] = fine
    err_fine = bin_errors(whole, SCALES, vocab)[lo: lo + FINE]
    err_c = coarse_errors(mass, vocab)
    rounding = rounding_eps(tp) * norm * (1 + 2.0 ** -40)
    return CoarseDecision(c, lo + j, norm, float(run[j]), float(err_c[:c].sum() + err_fine[:j].sum()) + rounding,
                          float(err_c[c + 1:].sum() + err_fine[j + 1:].sum()) + 2 * rounding, rounding)


def ranks_kept_coarse(slices: list[np.ndarray], offsets: list[int], temperature: float, top_p: float,
                      keys_per_rank: int = KEYS_PER_RANK):
    """The ranks' slices [V_r] of one row -> (kept masks per rank [V_r] bool, flags) through rounds 0-3."""
    slices = [np.asarray(s, F32) for s in slices]
    V, tp = sum(s.size for s in slices), len(slices)
    ih, il = inv_t_pair(temperature)
    l_top = F32(max(np.max(s) for s in slices))                                   # round 0
    bins_r, fixed_r = [], []
    for s in slices:
        bins, F = token_fixed(s, l_top, ih, il)
        part = np.zeros(BINS, np.int64)
        np.add.at(part, bins, F)
        bins_r.append(bins), fixed_r.append(part)
    mass, cum, c = coarse_crossing(np.stack([rank_coarse(f) for f in fixed_r]), top_p)          # round 1
    d = fine_crossing(mass, cum, c, np.sum([f[c * FINE: (c + 1) * FINE] for f in fixed_r], axis=0),
                      top_p, V, tp)                                                              # round 2
    b = d.bin
    kept = [bins < b for bins in bins_r]
    members = [np.flatnonzero(bins == b) for bins in bins_r]                      # round 3: counts, K keys
    if max(m.size for m in members) > keys_per_rank or sum(m.size for m in members) > MAX_BIN_KEYS:
        for k, m in zip(kept, members):
            k[m] = True
        return kept, BIN_OVERFLOW
    logit = np.concatenate([s[m] for s, m in zip(slices, members)])
    ids = np.concatenate([o + m for o, m in zip(offsets, members)])
    F = token_fixed(logit, l_top, ih, il)[1]                                      # from the keys' logits
    order = np.lexsort((ids, -logit.astype(np.float64)))
    prefix = np.cumsum(F[order])
    A = d.above + SCALES[b] * (prefix.astype(np.float64) * 2.0 ** -FIXED_BITS)
    reached = np.flatnonzero(A >= top_p * d.norm)
    cut = int(reached[0]) if reached.size else order.size - 1
    z_top = float(l_top) / temperature
    certified = certify(d.above, d.norm, d.err_above, d.err_below, SCALES[b], b, prefix, cut, top_p, V, z_top)
    tie = order_tie(logit, order, cut, temperature, z_top)
    cut_ids = ids[order[: cut + 1]]
    for k, m, o in zip(kept, members, offsets):
        k[m] = np.isin(o + m, cut_ids)
    return kept, 0 if certified and not tie else INEXACT


def ranks_sample_top_p_coarse(slices: list[np.ndarray], offsets: list[int], positions, temperature: float,
                              top_p: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """ranks_sample_top_p through the coarse-then-fine exchange (ranks_kept_coarse)."""
    return _sample(ranks_kept_coarse, slices, offsets, positions, temperature, top_p, seed)
