"""GPU tests of top-p without top-k (kernels/sample_top_p.cu) on adversarial rows: every row's kept set
(its size and its last token, from TreeSampler.row_state) and sampled token are the float64 definition's
(ddtree/tree/sampling.py), or the row is flagged; rows whose cumulative probability is 1e-9 or 1e-10 from
top_p are certified (not flagged), an exact tie is flagged INEXACT, a run of equal logits larger than the
cut bin holds is flagged BIN_OVERFLOW and kept whole. The device's bin, kept count and flags equal the
numpy twin's (ddtree/plugins/top_p_bins.py: the same float32 arithmetic). The status word is the OR of the
rows' flags.
"""
import numpy as np
import pytest
from test_top_p_bins import lm_row

from ddtree.plugins import top_p_bins as tb
from ddtree.tree.sampling import SamplingParams, kept_mask, sample

pytestmark = pytest.mark.gpu
V_BIG = 163840


@pytest.fixture(scope="module")
def samplers(gpu):
    from ddtree.plugins.tree_sample import TreeSampler
    cache = {}

    def get(V):
        if V not in cache:
            cache[V] = TreeSampler(gpu, vocab=V, max_rows=80)
        return cache[V]
    return get


def cumulative(l, T):
    z = l.astype(np.float64) / T
    e = np.exp(z - z.max())
    p = e / e.sum()
    order = np.argsort(-p, kind="stable")
    return order, np.cumsum(p[order])


def cases():
    """(name, logits [V] float32, T, top_p, certified: True / False / None = either)."""
    rng = np.random.default_rng(23)
    out = []
    for shape, T, where in [("flat", 1.0, 0.9), ("lm", 1.0, 0.95), ("flat", 0.7, 0.5)]:
        l = lm_row(rng, V_BIG, shape)
        order, c = cumulative(l, T)
        k = int(np.searchsorted(c, where))
        for delta in [1e-9, 1e-10, 1e-12, 0.0, -1e-10, -1e-9]:
            out.append((f"{shape} T {T} delta {delta:g}", l, T, float(c[k] - delta),
                        True if abs(delta) >= 1e-10 else (False if delta == 0 else None)))
    for tied, certified in [(3000, True), (6000, False)]:
        l = lm_row(rng, V_BIG, "flat")
        value = np.float32(np.sort(l)[::-1][5000])
        l[rng.choice(V_BIG, size=tied, replace=False)] = value
        order, c = cumulative(l, 1.0)
        run = np.flatnonzero(l[order] == value)
        i = run[len(run) // 2]
        out.append((f"{tied} tied at the cut", l, 1.0, float((c[i] + c[i - 1]) / 2), certified))
    out.append(("equal 1000", np.zeros(1000, np.float32), 1.0, 0.3705, True))
    out.append(("equal 163840", np.zeros(V_BIG, np.float32), 1.0, 0.37, False))
    tiny = np.full(2000, -1.0, np.float32)
    tiny[0] = 0.5
    tiny[1:1001] = np.arange(1, 1001, dtype=np.float32) * np.float32(1e-30)
    order, c = cumulative(tiny, 1.0)
    out.append(("equal probabilities, distinct logits", tiny, 1.0, float((c[500] + c[501]) / 2), False))
    for T, top_p in [(0.05, 0.9), (1.0, 1e-9), (1.0, 0.999999), (0.3, 0.99999)]:
        l = lm_row(rng, V_BIG, "lm")
        l[rng.choice(V_BIG, size=50, replace=False)] = -np.inf
        out.append((f"lm T {T} top_p {top_p}", l, T, top_p, True))
    out.append(("flat V 50000 (partial slice)", lm_row(rng, 50000, "flat"), 1.3, 0.8, True))
    return out


CASES = cases()


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_adversarial_row_is_the_definition_or_flagged(gpu, samplers, case):
    name, l, T, top_p, certified = CASES[case]
    V = l.size
    sampler = samplers(V)
    pos = np.array([12345], np.int32)
    params = SamplingParams(temperature=T, top_p=top_p, seed=(7 << 32) + case)
    out = sampler.run(gpu.upload(l[None]), gpu.upload(pos), params, 1)
    token = int(out.target.numpy()[0])
    st = sampler.row_state(1)[0]
    flags = sampler.check_status(allow_inexact=True)
    assert flags == int(st["flags"]), f"{name}: the status word is the row's flags"
    ref_kept = kept_mask(l[None].astype(np.float64) / T, 0, top_p)[0]
    order, _ = cumulative(l, T)
    if st["flags"] == 0:
        assert st["kept"] == ref_kept.sum(), f"{name}: kept {st['kept']}, definition {ref_kept.sum()}"
        assert 0xFFFFFFFF - (int(st["cut_key"]) & 0xFFFFFFFF) == order[ref_kept.sum() - 1], f"{name}: cut token"
        assert token == sample(l[None], pos.astype(np.int64) + 1, params)[0], f"{name}: token"
    if certified is not None:
        assert (st["flags"] == 0) == certified, f"{name}: flags {st['flags']}, expected certified={certified}"
    twin = tb.row_cut(l, T, top_p)
    if twin.bin < tb.CLAMP:
        assert (st["bin"], st["kept"], st["flags"]) == (twin.bin, twin.kept, twin.flags), name


def test_lm_batches_are_certified_and_the_definitions(gpu, samplers):
    """65 LM-like rows (a budget-64 tree's target logits) at V 163840 and V / 8: every row certified, every
    token the definition's; rows that kept more than 256 tokens are counted in full_row_rows."""
    from ddtree.bench.tree import lm_logits
    rng = np.random.default_rng(29)
    for V in (V_BIG, V_BIG // 8):
        sampler = samplers(V)
        x = lm_logits(rng, 65, V, False)
        pos = rng.integers(0, 1 << 30, size=65).astype(np.int32)
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=3)
        before = int(sampler.full_row_rows.numpy()[0])
        out = sampler.run(gpu.upload(x), gpu.upload(pos), params, 65)
        np.testing.assert_array_equal(out.target.numpy(), sample(x, pos.astype(np.int64) + 1, params))
        st = sampler.row_state(65)
        assert (st["flags"] == 0).all()
        ref = kept_mask(x.astype(np.float64), 0, 0.95).sum(axis=1)
        np.testing.assert_array_equal(st["kept"], ref)
        assert int(sampler.full_row_rows.numpy()[0]) - before == (ref > 256).sum()
        sampler.check_status()


@pytest.mark.parametrize("T,jitter", [(1.0, 0.0), (0.7, 0.0), (1.0, 1e-3), (0.7, 3e-4)])
def test_gumbel_near_ties_are_the_definitions(gpu, samplers, T, jitter):
    """Logits l = -T g (+ jitter): every token's z + g is 0 up to float32 rounding (or within a few
    Gumbel margins), so sample_kept's float32 bounds overlap at almost every comparison and the exact
    float64 path decides (lazy_consider / lazy_finish); the token must still be the definition's."""
    from ddtree.tree.sampling import gumbel
    rng = np.random.default_rng(int(T * 10) + int(jitter * 1e5))
    seed, pos = 11 + int(jitter * 1e4), np.array([777], np.int32)
    for V in (V_BIG, 20000):
        g = gumbel(seed, int(pos[0]) + 1, np.arange(V))
        l = (-T * g + jitter * rng.uniform(-1, 1, V)).astype(np.float32)[None]
        params = SamplingParams(temperature=T, top_p=0.95, seed=seed)
        sampler = samplers(V)
        out = sampler.run(gpu.upload(l), gpu.upload(pos), params, 1)
        st = sampler.row_state(1)[0]
        sampler.check_status(allow_inexact=True)
        assert st["kept"] > 1000, "the test needs a large kept set"
        if st["flags"] == 0:
            assert int(out.target.numpy()[0]) == sample(l, pos.astype(np.int64) + 1, params)[0], (V, T, jitter)
