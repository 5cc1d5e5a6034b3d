"""The sampling definition (docs/interfaces.md section 5): Philox4x32-10 known answers, Gumbel noise,
the distribution of samples against softmax on the kept set, and top-k / top-p edge cases."""
import math

import numpy as np
import pytest

from ddtree.tree.philox import philox4x32_10
from ddtree.tree.sampling import SamplingParams, gumbel, kept_mask, sample

# Random123 tests/kat_vectors, the "philox4x32 10" lines: counter, key -> output (32-bit words)
PHILOX_KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff),
     (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


@pytest.mark.parametrize("counter, key, want", PHILOX_KAT)
def test_philox_known_answers(counter, key, want):
    assert philox4x32_10(np.array(counter), np.array(key)).tolist() == list(want)


def test_philox_vectorised_equals_one_at_a_time():
    counters = np.array([c for c, _, _ in PHILOX_KAT])
    keys = np.array([k for _, k, _ in PHILOX_KAT])
    assert philox4x32_10(counters, keys).tolist() == [list(w) for _, _, w in PHILOX_KAT]


def test_gumbel_is_the_formula_over_word_zero():
    seed = (7 << 32) + 12345                       # key = (seed mod 2^32, seed >> 32) = (12345, 7)
    position, tokens = 4242, np.array([0, 1, 163839])
    x = [int(philox4x32_10(np.array([position, v, 0, 0]), np.array([12345, 7]))[0]) for v in tokens]
    want = [-math.log(-math.log((xi + 0.5) / 2 ** 32)) for xi in x]
    np.testing.assert_allclose(gumbel(seed, position, tokens), want, rtol=1e-15)
    assert gumbel(seed, position, tokens).tolist() != gumbel(seed + 1, position, tokens).tolist()


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = np.array([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -3.0, -0.5]])
    assert sample(logits, np.arange(3), SamplingParams()).tolist() == [1, 0, 3]


# ---------------------------------------------------------------------------------------------
# distribution: empirical frequencies over many positions vs softmax(z) on the kept set

def chi2_critical(dof: int, z: float = 4.265) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty); z = 4.265 is p = 1e-5."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_statistic(tokens, probs) -> float:
    counts = np.bincount(tokens, minlength=len(probs))
    expected = probs * len(tokens)
    assert counts[probs == 0].sum() == 0, "a token outside the kept set was sampled"
    nz = probs > 0
    return float(((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum())


LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.2, -0.3, -1.0, -2.5])
N_DRAWS = 20000


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def kept_probs(logits, temperature, keep):
    p = np.zeros(len(logits))
    p[keep] = softmax(logits[keep] / temperature)
    return p


@pytest.mark.parametrize("temperature, top_k, top_p, keep", [
    (1.0, 0, 1.0, list(range(8))),
    (0.6, 0, 1.0, list(range(8))),
    (1.7, 5, 1.0, [0, 1, 2, 3, 4]),
    (1.0, 0, 0.8, [0, 1, 2, 3]),          # cumulative .40 .64 .78 .87: crosses 0.8 at id 3, kept
    (0.8, 6, 0.9, [0, 1, 2, 3]),          # over the top 6: .47 .72 .85 .92
])
def test_sample_distribution_matches_softmax_on_kept_set(temperature, top_k, top_p, keep):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=2024)
    logits = np.tile(LOGITS, (N_DRAWS, 1))
    kept = kept_mask(logits / temperature, top_k, top_p)
    assert kept[0].nonzero()[0].tolist() == keep
    tokens = sample(logits, np.arange(N_DRAWS), params)
    probs = kept_probs(LOGITS, temperature, keep)
    assert chi2_statistic(tokens, probs) < chi2_critical(len(keep) - 1)


def test_distribution_test_rejects_a_sign_error_and_a_wrong_temperature():
    """The statistic above has the power to catch the two classic sampler bugs."""
    T, seed = 0.6, 2024
    positions = np.arange(N_DRAWS)
    z = np.tile(LOGITS / T, (N_DRAWS, 1))
    g = gumbel(seed, positions[:, None], np.arange(len(LOGITS))[None, :])       # [n, V]
    probs = kept_probs(LOGITS, T, list(range(8)))
    crit = chi2_critical(7)
    assert chi2_statistic(np.argmax(z + g, axis=1), probs) < crit               # the definition passes
    assert chi2_statistic(np.argmax(z - g, axis=1), probs) > crit               # sign error in g
    assert chi2_statistic(np.argmax(np.tile(LOGITS, (N_DRAWS, 1)) + g, axis=1), probs) > crit  # T ignored
    assert chi2_statistic(np.argmax(z * T * T + g, axis=1), probs) > crit      # l * T instead of l / T
    assert chi2_statistic(np.argmax(z * T / 0.66 + g, axis=1), probs) > crit   # T off by 10%


# ---------------------------------------------------------------------------------------------
# top-k / top-p edge cases

def test_top_p_reached_exactly_keeps_no_extra_token():
    z = np.array([[1.0, 1.0, 1.0, 1.0, -np.inf, -np.inf]])     # probabilities exactly 1/4 each
    assert kept_mask(z, 0, 0.5)[0].tolist() == [True, True, False, False, False, False]
    assert kept_mask(z, 0, 0.75)[0].tolist() == [True, True, True, False, False, False]
    assert kept_mask(z, 0, 0.5000001)[0].tolist() == [True, True, True, False, False, False]
    assert kept_mask(z, 0, 0.25)[0].tolist() == [True, False, False, False, False, False]
    z3 = np.array([[2.0, 2.0, 2.0, 2.0, 2.0]])
    assert kept_mask(z3, 3, 2.0 / 3.0)[0].tolist() == [True, True, False, False, False]   # 1/3 + 1/3 == 2/3


def test_top_k_ties_keep_the_lower_ids():
    z = np.array([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    assert kept_mask(z, 3, 1.0)[0].nonzero()[0].tolist() == [0, 2, 3]
    assert kept_mask(z, 1, 1.0)[0].nonzero()[0].tolist() == [0]


def test_top_p_ties_are_ordered_by_lower_id():
    z = np.array([[0.0, 1.0, 0.0, 1.0, 0.0]])                  # ids 1 and 3 tie on top
    p = softmax(z[0])
    assert p[1] < 0.5
    assert kept_mask(z, 0, p[1] * 0.999)[0].nonzero()[0].tolist() == [1]
    assert kept_mask(z, 0, p[1] + p[3] * 0.5)[0].nonzero()[0].tolist() == [1, 3]
    assert kept_mask(z, 0, 2 * p[1] + 1e-9)[0].nonzero()[0].tolist() == [0, 1, 3]        # next: lowest of 0, 2, 4


def test_top_p_one_or_more_and_top_k_zero_or_vocab_keep_everything():
    z = np.array([[50.0, 0.0, -50.0, -700.0]])                 # tail probabilities round to ~0
    for top_k, top_p in [(0, 1.0), (0, 1.5), (4, 1.0), (10, 1.0)]:
        assert kept_mask(z, top_k, top_p).all()


def test_top_k_one_is_greedy_at_any_temperature_and_seed():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 300))
    for seed in (0, 1, 2 ** 63 + 5):
        got = sample(logits, np.arange(64) + 1000, SamplingParams(temperature=3.0, top_k=1, seed=seed))
        assert got.tolist() == np.argmax(logits, axis=1).tolist()


def test_samples_never_leave_the_kept_set():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((500, 64)) * 3
    params = SamplingParams(temperature=1.3, top_k=10, top_p=0.7, seed=9)
    tokens = sample(logits, np.arange(500), params)
    kept = kept_mask(logits / 1.3, 10, 0.7)
    assert kept[np.arange(500), tokens].all()


def test_rows_are_independent_and_depend_on_position_and_seed():
    """A row's sample depends only on (its logits, its position, the seed): the property that
    makes DDTree and AR commit the same tokens."""
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((40, 50))
    positions = rng.permutation(1000)[:40]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=77)
    batch = sample(logits, positions, params)
    singles = [int(sample(logits[i:i + 1], positions[i:i + 1], params)[0]) for i in range(40)]
    assert batch.tolist() == singles
    perm = rng.permutation(40)
    assert sample(logits[perm], positions[perm], params).tolist() == batch[perm].tolist()
    flat = np.zeros((2000, 50))                                 # uniform logits: the noise alone decides
    a = sample(flat, np.arange(2000), params)
    assert (a != sample(flat, np.arange(2000) + 1, params)).mean() > 0.9
    assert (a != sample(flat, np.arange(2000), SamplingParams(temperature=1.0, top_p=0.95, seed=78))).mean() > 0.9


def test_bad_params_and_inputs_raise():
    for kwargs in ({"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"seed": -1}, {"seed": 1 << 64},
                   {"temperature": float("nan")}):
        with pytest.raises(ValueError, match="SamplingParams"):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="positions"):
        sample(np.zeros((2, 4)), np.arange(3), SamplingParams())
    with pytest.raises(ValueError, match="NaN"):
        sample(np.array([[0.0, np.nan]]), np.arange(1), SamplingParams(temperature=1.0))
