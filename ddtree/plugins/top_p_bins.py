"""numpy twin of the top-p kernels (kernels/sample_top_p.cu): float32 weights in exact fixed point, the
cut decided in float64 from the bin masses, and a certified error bound that says when the decision is
the sampling definition's (ddtree/tree/sampling.py kept_mask) and when it is not known to be.

The row's weights exp(d), d = (l - l_top) / T <= 0, go into 4096 bins of 1/128 of z below the top.
A token in bin b < 4095 has d = -b/128 + r with r in (-1/128, 0], so exp(d) = s_b exp(r): the bin's
scale s_b = exp(-b/128) is a float64 constant (bin_scales), and exp(r) = 1 + r + q(r) is formed in float32
from the float-float d (d_hi + d_lo: two-sum of l - l_top, two-product with 1/T as a float pair) and
stored as the integer F = round(exp(r) 2^35). Integer sums are exact in any order, so the bin masses
M_b = s_b F_b 2^-35 are deterministic, and every rounding is bounded:

    per token, bin b < 4095 (relative):  1.5 2^-35 (the two conversions, q in float32, q at a rounded r)
                                          + 2^-44 (b + 1) / 128 (d_hi + d_lo against (l - l_top) / T)
    per token, bin 4095 (d < -32, F = round(expf(r) 2^35), absolute in s_4095):  2^-16
    per bin: the token bound times F_b 2^-35 / 0.992 (n_b tokens weigh at least exp(-1/128) each),
             plus 2^-51 M_b (the scale table and the float64 product)

The cut: the first bin whose cumulative mass reaches top_p x norm, then that bin's tokens in key order
(logit desc, id asc: the definition's order) with their own F, the first whose cumulative reaches it.
Certified when the exact real cumulative, within our bound, is at least top_p + E_def at the cut and
below top_p - E_def just before it, where E_def bounds the definition's own float64 rounding (its cumsum
over up to V terms, the pairwise normaliser, z = l / T, exp):
    E_def = 1.05 u (V + 4 |z_top| + log2 V + 200),  u = 2^-53.
The definition's order and ours differ only where two different logits have equal float64 probability;
a cut between two such tokens is not certified either. Uncertified rows keep our cut and are flagged
INEXACT; a crossing bin with more than MAX_BIN_KEYS tokens is kept whole and flagged BIN_OVERFLOW.

Letters: V vocab, n rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddtree.tree.sampling import gumbel

BINS = 4096                    # SP_BINS
CLAMP = BINS - 1               # d < -4095/128: the far bin, weights relative to s_4095 through expf
FIXED_BITS = 35                # F = round(exp(r) 2^35)
MAX_BIN_KEYS = 4096            # SP_MAX_BIN_KEYS: tokens of the crossing bin sorted in shared memory
INEXACT, BIN_OVERFLOW = 16, 4  # SP_STATUS_INEXACT, SP_STATUS_BIN_OVERFLOW
U64 = 2.0 ** -53
TOKEN_EPS = 1.5 * 2.0 ** -FIXED_BITS
ARG_EPS = 2.0 ** -44
CLAMP_EPS = 2.0 ** -16
BIN_SLACK = 2.0 ** -51
SUM_SLACK = 64 * U64           # float64 rounding of the norm, the cumulative and the cut's sums (x norm)
# The twin's norm and cumulative masses are exactly rounded (mass_prefix), within u of the exact sums; the
# kernels' block scan is within ~24 u. np.cumsum's sequential float64 sum over 4095 bins is not: its worst
# case is ~4095 u x norm, past SUM_SLACK (tests/plugins/test_top_p_bins.py builds such masses).

F32 = np.float32
_MAGIC = F32(1.5 * 2 ** 23)


def inv_t_pair(temperature: float) -> tuple[np.float32, np.float32]:
    """1/T as a float pair (hi, lo): hi = float32(1/T), lo = float32(1/T - hi) (the kernels' SP_MAKE_ARGS)."""
    inv = 1.0 / float(temperature)
    hi = F32(inv)
    return hi, F32(inv - float(hi))


def _exact_fma(a, b, c) -> np.ndarray:
    """float32 fma(a, b, c) where a*b + c is exact in float32 (the two-product error terms used here)."""
    return (a.astype(np.float64) * b.astype(np.float64) + np.asarray(c, np.float64)).astype(F32)


def token_fixed(logits, l_top, ih, il) -> tuple[np.ndarray, np.ndarray]:
    """float32 logits [m] -> (bin [m] int32, F [m] int64), operation for operation the kernels' token_fixed."""
    with np.errstate(invalid="ignore", over="ignore"):
        l = np.asarray(logits, F32)
        top, ih, il = F32(l_top), F32(ih), F32(il)
        s = l - top                                     # s + e = l - l_top exactly (two-sum)
        bb = s - l
        e = (l - (s - bb)) + (-top - bb)
        d_hi = s * ih
        p_err = _exact_fma(s, np.full_like(s, ih), -d_hi)
        d_lo = p_err + (e * ih + s * il)
        t = d_hi * F32(-128.0)
        tc = np.where(t < F32(CLAMP), t, F32(CLAMP)).astype(F32)     # NaN -> the far bin
        tf = tc + F32(2 ** 23)
        kf = tf - F32(2 ** 23)
        k = tf.view(np.int32) - np.array(2 ** 23, F32).view(np.int32)
        down = kf > tc
        k = np.where(down, k - 1, k).astype(np.int32)
        kf = np.where(down, kf - F32(1), kf).astype(F32)
        near = k < CLAMP
        r_hi = d_hi + kf * F32(1 / 128)                 # exact (Sterbenz)
        x = r_hi + d_lo
        h = x * F32(1 / 120)
        h = F32(1 / 24) + h
        h = x * h
        h = F32(1 / 6) + h
        h = x * h
        h = F32(0.5) + h
        q = (x * x) * h
        k1 = np.rint(np.where(near, r_hi, F32(0)) * F32(2 ** FIXED_BITS)).astype(np.int64)
        rest = np.where(near, d_lo + q, F32(0)).astype(F32)
        k2 = ((rest * F32(2 ** FIXED_BITS) + _MAGIC).view(np.int32) - _MAGIC.view(np.int32)).astype(np.int64)
        r_far = (d_hi + F32(CLAMP / 128)) + d_lo
        w = np.exp(r_far)
        far = np.where(w > 0, np.rint(np.where(w > 0, w, F32(0)).astype(np.float64) * 2.0 ** FIXED_BITS), 0)
        F = np.where(near, (1 << FIXED_BITS) + k1 + k2, far.astype(np.int64))
    return k, F.astype(np.int64)


def bin_scales() -> np.ndarray:
    """s_b = exp(-b / 128) float64 [BINS] (the launcher uploads it; libm exp, within an ulp)."""
    return np.array([math.exp(-b / 128.0) for b in range(BINS)], np.float64)


def bin_errors(mass: np.ndarray, scales: np.ndarray, vocab: int) -> np.ndarray:
    """[BINS] float64 bounds of |M_b - exact mass of bin b| (the kernels' bin_error)."""
    b = np.arange(BINS)
    eps = TOKEN_EPS + ARG_EPS * (b + 1) / 128.0
    err = (1.02 * eps + BIN_SLACK) * mass
    err[CLAMP] = scales[CLAMP] * vocab * CLAMP_EPS + BIN_SLACK * mass[CLAMP]
    return err


def definition_error(vocab: int, z_top: float) -> float:
    """E_def: bound of |numpy's cumulative probability - the exact one| (see the module docstring)."""
    return 1.05 * U64 * (vocab + 4 * abs(z_top) + math.log2(max(vocab, 2)) + 200)


def mass_prefix(mass: np.ndarray) -> tuple[np.ndarray, float]:
    """(before [BINS]: the mass above each bin, norm), each the exactly rounded float64 of its real sum.
    Every float64 is an integer times 2^-1074, so the sums are exact in Python integers; int / int is
    correctly rounded."""
    scale = 1 << 1074
    ratios = [m.as_integer_ratio() for m in map(float, mass)]                   # (p, 2^k), k <= 1074
    units = [p * (scale // q) for p, q in ratios]
    total, before = 0, np.empty(len(units), np.float64)
    for i, x in enumerate(units):
        before[i] = total / scale
        total += x
    return before, total / scale


@dataclass
class RowCut:
    bin: int                   # the crossing bin b*
    kept: int                  # tokens kept (bins < b*, and the crossing bin's prefix)
    cut_id: int                # the last kept token in key order (-1 on overflow)
    flags: int                 # INEXACT | BIN_OVERFLOW, 0 when certified
    kept_mask: np.ndarray      # [V] bool


def row_cut(logits, temperature: float, top_p: float) -> RowCut:
    """One row's top-p kept set by the kernels' decision (sample_mass, then sample_kept's last block)."""
    l = np.asarray(logits, F32)
    V = l.size
    ih, il = inv_t_pair(temperature)
    l_top = F32(np.max(l))
    bins, F = token_fixed(l, l_top, ih, il)
    fixed = np.zeros(BINS, np.int64)
    np.add.at(fixed, bins, F)                                                     # exact integer sums
    scales = bin_scales()
    mass = scales * (fixed.astype(np.float64) * 2.0 ** -FIXED_BITS)               # [BINS]
    before, norm = mass_prefix(mass)                                              # mass above each bin
    target = top_p * norm
    crossing = np.flatnonzero((mass > 0) & (before + mass >= target))
    b = int(crossing[0]) if crossing.size else int(np.flatnonzero(mass > 0)[-1])
    err = bin_errors(mass, scales, V)
    above, err_above, err_below = float(before[b]), float(err[:b].sum()), float(err[b + 1:].sum())
    kept_mask = bins < b
    members = np.flatnonzero(bins == b)
    if members.size > MAX_BIN_KEYS:                                               # kept whole, flagged
        kept_mask[members] = True
        return RowCut(b, int(kept_mask.sum()), -1, BIN_OVERFLOW, kept_mask)
    order = members[np.lexsort((members, -l[members].astype(np.float64)))]       # key order
    prefix = np.cumsum(F[order])                                                  # exact
    A = above + scales[b] * (prefix.astype(np.float64) * 2.0 ** -FIXED_BITS)
    reached = np.flatnonzero(A >= target)
    cut = int(reached[0]) if reached.size else members.size - 1
    kept_mask[order[: cut + 1]] = True
    certified = certify(above, norm, err_above, err_below, scales[b], b, prefix, cut, top_p, V,
                        float(l_top) / temperature)
    tie = order_tie(l, order, cut, temperature, float(l_top) / temperature)
    flags = 0 if certified and not tie else INEXACT
    return RowCut(b, int(kept_mask.sum()), int(order[cut]), flags, kept_mask)


def certify(above, norm, err_above, err_below, scale, b, prefix, cut, top_p, vocab, z_top) -> bool:
    """The kernels' certify: is the cut at `cut` (prefix = the crossing bin's inclusive integer prefix sums
    in key order) the definition's, whatever the roundings within the bounds?"""
    total = int(prefix[-1])
    slack = SUM_SLACK * norm

    def bounds(i):                      # (A, B, error of A, error of B) with the first i + 1 bin tokens above
        p = int(prefix[i]) if i >= 0 else 0
        a_in, b_in = scale * (p * 2.0 ** -FIXED_BITS), scale * ((total - p) * 2.0 ** -FIXED_BITS)
        if b == CLAMP:
            e_a, e_b = scale * CLAMP_EPS * (i + 1), scale * CLAMP_EPS * (len(prefix) - i - 1)
        else:
            eps = 1.02 * (TOKEN_EPS + ARG_EPS * (b + 1) / 128.0) + BIN_SLACK
            e_a, e_b = eps * a_in, eps * b_in
        A = above + a_in
        return A, norm - A, err_above + e_a + slack, err_below + e_b + slack

    e_def = definition_error(vocab, z_top) + 8 * U64
    A, B, ea, eb = bounds(cut)
    low = (A - ea) / ((A - ea) + B + eb)                 # the exact cumulative at the cut is at least this
    A, B, ea, eb = bounds(cut - 1)
    high = (A + ea) / ((A + ea) + max(B - eb, 0.0))      # and just before it at most this
    return low - e_def >= top_p and high + e_def < top_p


def order_tie(l, order, cut, temperature, z_top) -> bool:
    """True when the cut token and the next one in key order could have equal float64 probabilities with
    different logits (the definition then orders them by id): a gap in z below 2^-44 (1 + |z_top| + |d|).
    The next token is the bin's next, or for the bin's last token the nearest float32 below."""
    l_cut = np.float64(l[order[cut]])
    l_next = np.float64(l[order[cut + 1]]) if cut + 1 < order.size else \
        np.float64(np.nextafter(F32(l_cut), F32(-np.inf)))
    if l_next == l_cut:
        return False
    d_cut = abs(l_cut / temperature - z_top)
    return (l_cut - l_next) / temperature <= 2.0 ** -44 * (1 + abs(z_top) + d_cut)


def sample_top_p(logits, positions, temperature: float, top_p: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """logits [n, V] float32 -> (tokens [n] int64, flags [n]): Gumbel-max over row_cut's kept set."""
    logits = np.asarray(logits, F32)
    positions = np.asarray(positions, np.int64).reshape(-1)
    tokens, flags = np.zeros(len(logits), np.int64), np.zeros(len(logits), np.int64)
    for i, row in enumerate(logits):
        rc = row_cut(row, temperature, top_p)
        ids = np.flatnonzero(rc.kept_mask)
        noisy = row[ids].astype(np.float64) / temperature + gumbel(seed, positions[i], ids)
        tokens[i], flags[i] = ids[int(np.argmax(noisy))], rc.flags
    return tokens, flags
