"""The routing generator (issue 21) against binomial statistics and the meter's uniform formula.

Tolerances: a tree layer's reused-slot count over its n - 1 non-root nodes is Binomial(k (n - 1), p)
(each slot independently takes a parent expert with probability p), so over L layers the measured
rate has standard error sqrt(p (1 - p) / (L k (n - 1))); the tests allow 4 of them (a false failure
about 1 in 16000). The distinct count of M uniform tokens has the exact variance below; 4 standard
errors of the mean over L layers.
"""
import math

import numpy as np
import pytest

from ddtree.backends.meter import expected_distinct
from ddtree.bench.routing import distinct_per_layer, reuse_rate, routing_ids, tree_ids, uniform_ids

E, K = 384, 8


def random_tree(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])


@pytest.mark.parametrize("p", [0.0, 0.5, 0.8])
def test_tree_reuse_rate_is_p_within_the_binomial_standard_error(p):
    parents, L = random_tree(64, seed=1), 200
    ids = tree_ids(np.random.default_rng(7), parents, E, K, p, layers=L)               # [L, 64, 8]
    assert ids.shape == (L, 64, K) and ids.dtype == np.int32
    assert ids.min() >= 0 and ids.max() < E
    assert all(len(set(row)) == K for row in ids.reshape(-1, K))                       # distinct per token
    slots = L * K * (len(parents) - 1)
    se = math.sqrt(p * (1 - p) / slots)
    rate = reuse_rate(ids, parents)
    if p == 0.0:
        assert rate == 0.0
    else:
        assert abs(rate - p) < 4 * se, (rate, p, se)


def test_reuse_one_inherits_the_roots_set_everywhere():
    parents = random_tree(20, seed=2)
    ids = tree_ids(np.random.default_rng(0), parents, E, K, 1.0, layers=5)
    for layer in ids:
        assert all(set(row) == set(layer[0]) for row in layer)
    assert distinct_per_layer(ids).tolist() == [K] * 5


def test_reuse_rate_and_distinct_against_a_loop():
    rng = np.random.default_rng(3)
    parents = random_tree(12, seed=3)
    ids = tree_ids(rng, parents, 40, 4, 0.5, layers=3)
    found = total = 0
    for layer in ids:
        for i in range(1, len(parents)):
            found += sum(e in set(layer[parents[i]]) for e in layer[i])
            total += 4
    assert reuse_rate(ids, parents) == found / total
    assert distinct_per_layer(ids).tolist() == [len(set(layer.ravel())) for layer in ids]
    held = [len({e for e in layer.ravel() if 10 <= e < 20}) for layer in ids]
    assert distinct_per_layer(ids, (10, 20)).tolist() == held


@pytest.mark.parametrize("M", [1, 17, 65])
def test_uniform_distinct_experts_match_the_meters_formula(M):
    L = 400
    ids = uniform_ids(np.random.default_rng(M), M, E, K, layers=L)
    assert all(len(set(row)) == K for row in ids.reshape(-1, K))
    d = distinct_per_layer(ids)
    q1 = (1 - K / E) ** M                                         # P(an expert untouched)
    q2 = ((E - K) * (E - K - 1) / (E * (E - 1))) ** M              # P(two given experts untouched)
    var = E * q1 * (1 - q1) + E * (E - 1) * (q2 - q1 * q1)
    mean = expected_distinct(E, E, K, M)
    assert mean == pytest.approx(E * (1 - q1))
    if M == 1:
        assert d.tolist() == [K] * L
    else:
        assert abs(d.mean() - mean) < 4 * math.sqrt(var / L), (d.mean(), mean)


def test_seeded_and_refusals():
    parents = random_tree(8, seed=4)
    a = routing_ids("tree", parents, E, K, 0.5, layers=3, seed=9)
    assert np.array_equal(a, routing_ids("tree", parents, E, K, 0.5, layers=3, seed=9))
    assert routing_ids("uniform", parents, E, K, 0.0, layers=3, seed=9).shape == (3, 8, K)
    assert uniform_ids(np.random.default_rng(0), 5, E, K).shape == (5, K)
    with pytest.raises(ValueError, match="routing 'zipf'"):
        routing_ids("zipf", parents, E, K, 0.5, layers=1)
    with pytest.raises(ValueError, match="reuse 1.5"):
        tree_ids(np.random.default_rng(0), parents, E, K, 1.5)
    with pytest.raises(ValueError, match="parents"):
        tree_ids(np.random.default_rng(0), [0, 0, 1], E, K, 0.5)
