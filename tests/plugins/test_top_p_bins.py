"""CPU tests of top-p's certified float32 path (ddtree/plugins/top_p_bins.py, the twin of
kernels/sample_top_p.cu) against the float64 definition (ddtree/tree/sampling.py):

- the kernels' token arithmetic (kernels/top_p_fixed.cuh, compiled here as host C++ with g++) gives the
  twin's bins and fixed-point weights bit for bit;
- every token's weight and every bin's mass are within the stated bounds of the exact value (80-bit
  long double reference);
- the kept set is the definition's or the row is flagged, on adversarial rows: cumulative probability
  within 1e-9 .. 0 of top_p on both sides (certified at 1e-9 and 1e-10, flagged at an exact tie),
  thousands of tied logits at the cut (exact below 4096 in the cut bin, flagged BIN_OVERFLOW above),
  flat rows, distinct logits with equal float64 probabilities (flagged), temperatures that put most of the
  row in the far bin, and random LM-like and standard-normal rows (certified).
"""
import shutil
import subprocess

import numpy as np
import pytest

from ddtree.plugins import top_p_bins as tb
from ddtree.plugins.compile import KERNEL_DIR
from ddtree.tree.sampling import SamplingParams, kept_mask, sample

HARNESS = r"""
#include <cstdio>
#include <vector>
#include "top_p_fixed.cuh"
int main() {
    float head[4];                              // count, l_top, ih, il
    while (std::fread(head, 4, 4, stdin) == 4) {
        int n = (int)head[0];
        std::vector<float> l(n);
        if (std::fread(l.data(), 4, n, stdin) != (size_t)n) return 1;
        for (int i = 0; i < n; ++i) {
            int bin;
            long long F = tp_token_fixed(l[i], head[1], head[2], head[3], bin);
            int bin2 = tp_token_bin(l[i], head[1], head[2]);
            std::fwrite(&bin, 4, 1, stdout); std::fwrite(&bin2, 4, 1, stdout); std::fwrite(&F, 8, 1, stdout);
        }
    }
    return 0;
}
"""


def edge_logits(rng, top: float) -> np.ndarray:
    """Logits at the awkward places: the top itself, bin edges in z, zeros, denormals, huge, -inf, NaN."""
    base = [top, 0.0, -0.0, 1e-30, -1e-30, 1e-42, -1e-42, np.float32(top) - np.float32(1e-6), -3e38, 3e-38,
            -np.inf, np.nan, top - 31.99, top - 32.0, top - 32.01, top - 100.0]
    edges = [top - k / 128.0 for k in range(0, 4200, 37)]
    wiggle = np.nextafter(np.array(edges, np.float32), np.float32(np.inf))
    return np.concatenate([np.array(base + edges, np.float32), wiggle,
                           (rng.standard_normal(5000) * 6).astype(np.float32)])


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the header as host code")
def test_kernel_token_arithmetic_is_the_twins(tmp_path):
    (tmp_path / "h.cpp").write_text(HARNESS)
    exe = tmp_path / "h"
    subprocess.run(["g++", "-O2", "-std=c++17", "-ffp-contract=off", f"-I{KERNEL_DIR}", str(tmp_path / "h.cpp"),
                    "-o", str(exe)], check=True)
    rng = np.random.default_rng(3)
    cases = []
    for T, top in [(1.0, 7.5), (0.7, 12.25), (1.3, -3.0), (0.05, 30.0), (3.0, 0.0), (0.9, 1e-30)]:
        ih, il = tb.inv_t_pair(T)
        cases.append((edge_logits(rng, top), np.float32(top), ih, il))
    blob = b"".join(np.array([len(l), top, ih, il], np.float32).tobytes() + l.tobytes() for l, top, ih, il in cases)
    out = subprocess.run([str(exe)], input=blob, capture_output=True, check=True).stdout
    rec = np.frombuffer(out, dtype=[("bin", "<i4"), ("bin2", "<i4"), ("F", "<i8")])
    at = 0
    for l, top, ih, il in cases:
        got = rec[at: at + len(l)]
        at += len(l)
        bins, F = tb.token_fixed(l, top, ih, il)
        np.testing.assert_array_equal(got["bin"], bins)
        np.testing.assert_array_equal(got["bin2"], bins)
        near = bins < tb.CLAMP
        np.testing.assert_array_equal(got["F"][near], F[near])
        # the far bin goes through expf: libm's and numpy's may differ by an ulp or two of 2^-24
        assert np.abs(got["F"][~near] - F[~near]).max() <= 1 << 13


@pytest.mark.parametrize("T", [1.0, 0.7, 1.3, 0.05, 3.0, 0.9])
def test_token_weights_within_their_bound(T):
    rng = np.random.default_rng(int(T * 100))
    top = np.float32(rng.uniform(-5, 20))
    l = edge_logits(rng, float(top))
    l = l[np.isfinite(l)]
    top = np.float32(l.max())
    bins, F = tb.token_fixed(l, top, *tb.inv_t_pair(T))
    exact = np.exp((l.astype(np.longdouble) - np.longdouble(top)) / np.longdouble(T))
    s = tb.bin_scales().astype(np.longdouble)
    got = s[bins] * F.astype(np.longdouble) * np.longdouble(2.0) ** -tb.FIXED_BITS
    near = bins < tb.CLAMP
    eps = tb.TOKEN_EPS + tb.ARG_EPS * (bins[near] + 1) / 128.0
    assert (np.abs(got[near] - exact[near]) <= eps * exact[near]).all()
    assert (np.abs(got[~near] - exact[~near]) <= tb.CLAMP_EPS * s[tb.CLAMP]).all()
    # the bins are 1/128 of z wide below the top, monotone in the logit
    d = -(l.astype(np.float64) - float(top)) / T
    assert (np.abs(np.minimum(d * 128, tb.CLAMP) - bins) <= 1.0 + 1e-6).all()
    order = np.argsort(l)
    assert (np.diff(bins[order]) <= 0).all()


@pytest.mark.parametrize("shape,T", [("flat", 1.0), ("lm", 1.0), ("lm", 0.6), ("flat", 0.05)])
def test_bin_masses_within_their_bound(shape, T):
    rng = np.random.default_rng(5)
    l = lm_row(rng, 163840, shape)
    top = np.float32(l.max())
    bins, F = tb.token_fixed(l, top, *tb.inv_t_pair(T))
    fixed = np.zeros(tb.BINS, np.int64)
    np.add.at(fixed, bins, F)
    scales = tb.bin_scales()
    mass = scales * (fixed * 2.0 ** -tb.FIXED_BITS)
    exact = np.zeros(tb.BINS, np.longdouble)
    np.add.at(exact, bins, np.exp((l.astype(np.longdouble) - np.longdouble(top)) / np.longdouble(T)))
    err = tb.bin_errors(mass, scales, l.size)
    assert (np.abs(mass - exact) <= err).all()
    assert (err[:-1] <= 2e-10 * mass[:-1]).all()                # the bound is tight enough to be useful


def lm_row(rng, V: int, shape: str) -> np.ndarray:
    """float32 [V]: standard normal ('flat') or an LM-like row ('lm': N(0, 2^2) floor, ~20 strong tokens)."""
    x = rng.standard_normal(V).astype(np.float32)
    if shape == "lm":
        x *= 2
        strong = rng.choice(V, size=20, replace=False)
        x[strong] += rng.uniform(6, 14, size=20).astype(np.float32)
    return x


def definition(l: np.ndarray, T: float, top_p: float) -> np.ndarray:
    return kept_mask(l[None].astype(np.float64) / T, 0, top_p)[0]


def cumulative(l: np.ndarray, T: float) -> tuple[np.ndarray, np.ndarray]:
    """The definition's (order, cumulative probability along it) for one row."""
    z = l.astype(np.float64) / T
    e = np.exp(z - z.max())
    p = e / e.sum()
    order = np.argsort(-p, kind="stable")
    return order, np.cumsum(p[order])


def assert_definition_or_flagged(l, T, top_p, what, certified=None):
    rc = tb.row_cut(l, T, top_p)
    ref = definition(l, T, top_p)
    if rc.flags == 0:
        np.testing.assert_array_equal(rc.kept_mask, ref, err_msg=f"{what}: certified but not the definition's")
    if certified is not None:
        assert (rc.flags == 0) == certified, f"{what}: flags {rc.flags}, expected certified={certified}"
    return rc


@pytest.mark.parametrize("shape,T,where", [("flat", 1.0, 0.9), ("flat", 0.7, 0.5), ("lm", 1.0, 0.95),
                                           ("lm", 1.3, 0.99), ("flat", 2.0, 0.2)])
def test_cut_within_1e9_of_top_p(shape, T, where):
    """top_p = the definition's cumulative at a token -/+ delta: certified and equal for |delta| >= 1e-10,
    flagged at delta = 0 (an exact float64 tie only the definition's own rounding decides)."""
    rng = np.random.default_rng(int(where * 100) + len(shape))
    l = lm_row(rng, 163840, shape)
    order, c = cumulative(l, T)
    k = int(np.searchsorted(c, where))
    for delta in [1e-9, 1e-10, 1e-11, 1e-12, 0.0, -1e-12, -1e-11, -1e-10, -1e-9]:
        top_p = float(c[k] - delta)
        certain = abs(delta) >= 1e-10 or None
        rc = assert_definition_or_flagged(l, T, top_p, f"{shape} T {T} delta {delta:g}", certain)
        if delta == 0.0:
            assert rc.flags == tb.INEXACT, "an exact tie with the definition's cumulative must be flagged"
        if rc.flags == 0:
            assert rc.kept == (k + 1 if delta >= 0 else k + 2)


@pytest.mark.parametrize("tied", [100, 3000, 4000])
def test_thousands_of_tied_logits_at_the_cut(tied):
    """A run of equal logits straddles the cut: the definition keeps its lowest ids; so do the kernels."""
    rng = np.random.default_rng(tied)
    V = 163840
    l = lm_row(rng, V, "flat")
    value = np.float32(np.sort(l)[::-1][5000])
    l[rng.choice(V, size=tied, replace=False)] = value
    order, c = cumulative(l, 1.0)
    run = np.flatnonzero(l[order] == value)
    for frac in (0.1, 0.5, 0.93):
        top_p = float((c[run[int(frac * (len(run) - 1))]] + c[run[int(frac * (len(run) - 1))] - 1]) / 2)
        rc = assert_definition_or_flagged(l, 1.0, top_p, f"{tied} tied at {frac}", certified=True)
        assert l[rc.cut_id] == value


def test_more_tied_logits_than_the_cut_bin_holds_are_flagged():
    rng = np.random.default_rng(9)
    l = lm_row(rng, 163840, "flat")
    value = np.float32(np.sort(l)[::-1][5000])
    l[rng.choice(l.size, size=6000, replace=False)] = value
    order, c = cumulative(l, 1.0)
    top_p = float(c[np.flatnonzero(l[order] == value)[3000]])
    rc = tb.row_cut(l, 1.0, top_p)
    assert rc.flags == tb.BIN_OVERFLOW and rc.kept_mask[l == value].all()


def test_flat_rows():
    """All-equal rows: exact below the cut bin's capacity (flagged where top_p is exactly k / V), flagged
    BIN_OVERFLOW above it."""
    l = np.zeros(1000, np.float32)
    assert_definition_or_flagged(l, 1.0, 0.3705, "equal 1000", certified=True)
    assert_definition_or_flagged(l, 0.5, 0.0001, "equal 1000, one token", certified=True)
    assert tb.row_cut(l, 1.0, 0.37).flags == tb.INEXACT            # 370 / 1000 == 0.37: the definition's rounding
    assert tb.row_cut(np.zeros(163840, np.float32), 1.0, 0.37).flags == tb.BIN_OVERFLOW


def test_distinct_logits_with_equal_probabilities_are_flagged():
    """Logits that differ by 1e-30 have equal float64 probabilities: the definition orders them by id,
    the kernels by logit; a cut between two of them is flagged, one elsewhere is not."""
    l = np.full(2000, -1.0, np.float32)
    l[0] = 0.5
    l[1:1001] = np.arange(1, 1001, dtype=np.float32) * np.float32(1e-30)   # ids and logits ascending
    order, c = cumulative(l, 1.0)
    inside = float((c[500] + c[501]) / 2)
    rc = tb.row_cut(l, 1.0, inside)
    assert rc.flags == tb.INEXACT
    assert (rc.kept_mask != definition(l, 1.0, inside)).any(), "the orders must really differ there"
    below = float((c[1500] + c[1501]) / 2)
    assert_definition_or_flagged(l, 1.0, below, "cut past the tiny run", certified=True)


@pytest.mark.parametrize("T,top_p", [(0.05, 0.9), (0.05, 0.999999), (1.0, 1e-9), (1.0, 0.999999), (0.3, 0.99999)])
def test_extreme_temperatures_and_top_p(T, top_p):
    rng = np.random.default_rng(11)
    for shape in ("lm", "flat"):
        l = lm_row(rng, 163840, shape)
        assert_definition_or_flagged(l, T, top_p, f"{shape} T {T} top_p {top_p}", certified=True)


def test_random_rows_are_certified():
    """Rows as the bench makes them: every one certified and the definition's."""
    rng = np.random.default_rng(13)
    for i in range(24):
        shape = ("lm", "flat")[i % 2]
        T = float(rng.choice([0.6, 0.8, 1.0, 1.2, 1.5]))
        top_p = float(rng.choice([0.5, 0.8, 0.9, 0.95, 0.99]))
        l = lm_row(rng, int(rng.choice([20480, 163840, 1000])), shape)
        l[rng.choice(l.size, size=10, replace=False)] = -np.inf
        assert_definition_or_flagged(l, T, top_p, f"row {i} {shape} T {T} top_p {top_p}", certified=True)


def test_twin_tokens_are_the_definitions():
    rng = np.random.default_rng(17)
    x = np.stack([lm_row(rng, 20480, s) for s in ("lm", "flat", "lm", "flat")])
    positions = rng.integers(0, 1 << 31, size=4)
    tokens, flags = tb.sample_top_p(x, positions, 0.9, 0.9, seed=(3 << 32) + 5)
    assert (flags == 0).all()
    np.testing.assert_array_equal(tokens, sample(x, positions, SamplingParams(temperature=0.9, top_p=0.9,
                                                                              seed=(3 << 32) + 5)))


def adding_up_masses() -> np.ndarray:
    """Bin masses whose sequential float64 cumsum errs by ~2048 u x norm: 1 then 4094 x 3/4 ulp(1) (each
    addition rounds up by 1/4 ulp), past SUM_SLACK's 64 u."""
    return np.concatenate([[1.0], np.full(tb.BINS - 2, 0.75 * 2.0 ** -52), [0.0]])


@pytest.mark.parametrize("kind", ["adding_up", "lm_like", "tiny_and_huge"])
def test_mass_prefix_is_exactly_rounded(kind):
    from fractions import Fraction
    rng = np.random.default_rng(7)
    mass = {"adding_up": adding_up_masses,
            "lm_like": lambda: tb.bin_scales() * rng.integers(0, 2 ** 45, tb.BINS) * 2.0 ** -35,
            "tiny_and_huge": lambda: np.where(rng.random(tb.BINS) < 0.5, 1e-300, 1e3) * rng.random(tb.BINS)}[kind]()
    before, norm = tb.mass_prefix(mass)
    exact, run = [], Fraction(0)
    for m in mass:
        exact.append(run)
        run += Fraction(float(m))
    assert norm == float(run)                                   # Fraction -> float rounds correctly
    assert all(b == float(e) for b, e in zip(before, exact))
    if kind == "adding_up":                                     # the sequential cumsum this replaces is not
        drift = abs(float(np.cumsum(mass)[-1]) - float(run))
        assert drift > tb.SUM_SLACK * norm


def test_row_cut_uses_the_exactly_rounded_prefix(monkeypatch):
    """row_cut's and ranks_kept's norm and cumulative come from mass_prefix (not a sequential cumsum)."""
    from ddtree.plugins import top_p_ranks
    calls = []
    real = tb.mass_prefix
    monkeypatch.setattr(tb, "mass_prefix", lambda m: calls.append(1) or real(m))
    monkeypatch.setattr(top_p_ranks, "mass_prefix", lambda m: calls.append(2) or real(m))
    row = np.random.default_rng(3).standard_normal(4096).astype(np.float32)
    tb.row_cut(row, 1.0, 0.9)
    top_p_ranks.ranks_kept([row[:2048], row[2048:]], [0, 2048], 1.0, 0.9)
    assert calls == [1, 2]
