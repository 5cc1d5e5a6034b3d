"""--budget auto, CPU side: expected acceptance per budget vs brute-force enumeration of the target's
outcomes walked with accept_walk; the calibration fit vs an independent isotonic formula and a known
truth; the choice vs a hand-made cost table."""
import itertools

import numpy as np
import pytest

from ddtree.tree.budget import (
    BudgetError,
    Calibration,
    _pool_adjacent_violators,
    choose_budget,
    edge_draft_probs,
    expected_accept_for_table,
    expected_accept_from_edges,
    expected_accept_prefix,
    fit_calibration,
)
from ddtree.tree.build import Tree, build_tree, topk_logprobs
from ddtree.tree.walk import accept_walk

V = 3                       # vocabulary of the enumerated trees: every target outcome is enumerable


def prefix_tree(tree: Tree, b: int) -> Tree:
    """The first b pops (nodes 0..b)."""
    n = b + 1
    return Tree(tree.tokens[:n], tree.parents[:n], tree.depth[:n], tree.ranks[:n], tree.scores[:n])


def small_tree(seed: int, budget: int) -> tuple[Tree, np.ndarray]:
    rng = np.random.default_rng(seed)
    D, k = int(rng.integers(1, 4)), int(rng.integers(1, V + 1))
    logp, ids = topk_logprobs(rng.standard_normal((D, V)).astype(np.float32) * 2, k)
    return build_tree(0, logp, ids, budget), logp


def brute_force_per_node(tree: Tree, q: np.ndarray) -> float:
    """E[committed] when the target's token at node i is drawn from q[i] (independently per node): every
    outcome y in V^n, its probability, the walk's committed count (accepted nodes, root included = accepted
    drafts + the bonus)."""
    total = 0.0
    for y in itertools.product(range(V), repeat=tree.size):
        p = np.prod([q[i, y[i]] for i in range(tree.size)])
        total += p * accept_walk(tree, np.array(y)).committed_tree_tokens
    return total


def brute_force_per_depth(tree: Tree, q: np.ndarray) -> float:
    """The same with one shared draw per depth (every node at depth d sees the token z[d] ~ q[d])."""
    D = int(tree.depth.max())
    total = 0.0
    for z in itertools.product(range(V), repeat=D + 1):
        p = np.prod([q[d, z[d]] for d in range(D + 1)])
        total += p * accept_walk(tree, np.array([z[d] for d in tree.depth])).committed_tree_tokens
    return total


@pytest.mark.parametrize("seed", range(6))
def test_expected_accept_prefix_matches_enumeration(seed):
    tree, _ = small_tree(seed, 6)
    rng = np.random.default_rng(100 + seed)
    q_node = rng.dirichlet(np.ones(V) * 0.7, size=tree.size)           # [n, V] the target at each node
    q_depth = rng.dirichlet(np.ones(V) * 0.7, size=int(tree.depth.max()) + 1)
    # an edge parent -> c is accepted when the target's token at the parent is c's token
    edge_node = np.array([1.0] + [q_node[tree.parents[c], tree.tokens[c]] for c in range(1, tree.size)])
    edge_depth = np.array([1.0] + [q_depth[tree.depth[c] - 1, tree.tokens[c]] for c in range(1, tree.size)])
    e_node = expected_accept_from_edges(tree.parents, edge_node)
    e_depth = expected_accept_from_edges(tree.parents, edge_depth)
    assert e_node.shape == (tree.size,) and e_node[0] == 1.0
    for b in range(tree.size):
        sub = prefix_tree(tree, b)
        assert abs(e_node[b] - brute_force_per_node(sub, q_node)) < 1e-12
        assert abs(e_depth[b] - brute_force_per_depth(sub, q_depth)) < 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_the_tree_of_budget_b_is_the_first_b_pops(seed):
    rng = np.random.default_rng(seed)
    logp, ids = topk_logprobs(rng.standard_normal((4, 50)).astype(np.float32), 8)
    big = build_tree(7, logp, ids, 40)
    for b in (1, 3, 8, 17, 40):
        small = build_tree(7, logp, ids, b)
        assert small.ranks == big.ranks[: b + 1] and np.array_equal(small.parents, big.parents[: b + 1])


def test_expected_accept_from_a_table_uses_the_draft_probabilities():
    rng = np.random.default_rng(3)
    logp, ids = topk_logprobs(rng.standard_normal((3, 20)).astype(np.float32), 4)
    tree = build_tree(5, logp, ids, 12)
    p = edge_draft_probs(tree, logp)
    for i in range(1, tree.size):                          # the node's token's draft probability at its depth
        d, r = tree.depth[i], tree.ranks[i][-1]
        assert ids[d - 1, r] == tree.tokens[i] and p[i] == pytest.approx(np.exp(float(logp[d - 1, r])), rel=1e-12)
        # the product of edge probabilities along the path is exp(the builder's path score)
    path = expected_accept_from_edges(tree.parents, p)
    assert np.allclose(np.diff(path), np.exp(tree.scores[1:].astype(np.float64)), rtol=1e-5)
    e = expected_accept_for_table(5, logp, ids, 12)
    assert np.array_equal(e, expected_accept_prefix(tree, logp))
    # 3 depths x 4 candidates = 84 prefixes: a budget past them repeats the last value
    e_big = expected_accept_for_table(5, logp[:1], ids[:1], 10)
    assert e_big.shape == (11,) and np.all(e_big[4:] == e_big[4])


# ----------------------------------------------------------------------------------------------
# calibration

def isotonic_min_max(y, w):
    """Independent reference: the weighted isotonic fit is max_{j<=i} min_{k>=i} mean(y[j..k])."""
    n = len(y)
    mean = lambda j, k: np.dot(y[j:k + 1], w[j:k + 1]) / w[j:k + 1].sum()
    return np.array([max(min(mean(j, k) for k in range(i, n)) for j in range(i + 1)) for i in range(n)])


@pytest.mark.parametrize("seed", range(5))
def test_pool_adjacent_violators_is_the_isotonic_fit(seed):
    rng = np.random.default_rng(seed)
    y, w = rng.random(15), rng.integers(1, 9, 15).astype(np.float64)
    assert np.allclose(_pool_adjacent_violators(y, w), isotonic_min_max(y, w), rtol=0, atol=1e-12)


def test_fit_recovers_a_known_per_depth_acceptance():
    rng = np.random.default_rng(0)
    n = 40000
    depth = rng.integers(1, 4, n)                          # depths 1..3, plus 20 samples at depth 4
    depth[:20] = 4
    p = rng.random(n)
    truth = {1: lambda x: x ** 2, 2: lambda x: 0.5 * x, 3: lambda x: np.sqrt(x), 4: None}
    rate = np.where(depth == 1, p ** 2, np.where(depth == 2, 0.5 * p, np.sqrt(p)))
    accepted = rng.random(n) < rate
    cal = fit_calibration(p, accepted, depth)
    grid = np.linspace(0.05, 0.95, 19)
    for d in (1, 2, 3):
        assert np.max(np.abs(cal.calibrate(grid, d) - truth[d](grid))) < 0.05, d
        assert np.all(np.diff(cal.calibrate(np.linspace(0, 1, 101), d)) >= 0)
    assert cal.depths[3] is None                           # 20 samples: depth 4 uses the all-depths map
    assert np.array_equal(cal.calibrate(grid, 4), cal.calibrate(grid, 9))
    again = Calibration.from_json(cal.to_json())
    assert np.array_equal(again.calibrate(p[:500], depth[:500]), cal.calibrate(p[:500], depth[:500]))


def test_identity_calibration_and_bad_maps_are_named():
    assert np.allclose(Calibration.identity().calibrate([0.0, 0.3, 1.0], 2), [0.0, 0.3, 1.0])
    good = {"x": [0.1, 0.5], "y": [0.2, 0.6], "samples": 9}
    with pytest.raises(BudgetError, match=r"cal.depths\[1\] \(depth 2\)"):
        Calibration.from_json({"depths": [good, {"x": [0.1, 0.5], "y": [0.7, 0.6], "samples": 9}],
                               "pooled": good}, "cal")
    with pytest.raises(BudgetError, match="cal.pooled"):
        Calibration.from_json({"depths": [], "pooled": {"x": [0.1], "y": [1.5], "samples": 1}}, "cal")
    with pytest.raises(BudgetError, match="accepted_flags 0/1"):
        fit_calibration([0.5], [2], [1])


# ----------------------------------------------------------------------------------------------
# the choice

def test_choose_budget_finds_the_best_budget_in_the_middle():
    # acceptance saturates while the verify gets dearer (more experts): tokens per us
    # 1: 1.9/1000 = .00190, 2: 2.6/1010 = .00257, 4: 3.4/1030 = .00330, 8: 4.2/1100 = .00382,
    # 16: 4.6/1400 = .00329, 32: 4.8/2000 = .00240 -> 8
    e = np.interp(np.arange(33), [0, 1, 2, 4, 8, 16, 32], [1.0, 1.9, 2.6, 3.4, 4.2, 4.6, 4.8])
    times = {1: 1000.0, 2: 1010.0, 4: 1030.0, 8: 1100.0, 16: 1400.0, 32: 2000.0}
    assert choose_budget(e, times, times) == 8
    assert choose_budget(e, times, [1, 2, 16, 32]) == 16            # only captured budgets count
    assert choose_budget(e, times, [32, 4]) == 4


def test_choose_budget_ties_go_to_the_smaller_budget():
    e = [1.0, 2.0, 4.0, 4.0]
    assert choose_budget(e, {1: 20.0, 2: 40.0}, [2, 1]) == 1        # 2/20 == 4/40
    e = [1.0, 0.1 + 0.2, 0.6]                                       # 0.30000000000000004 / 3 vs 0.6 / 6
    assert choose_budget(e, {1: 3.0, 2: 6.0}, [1, 2]) == 1
    assert choose_budget([1.0, 2.0, 4.0], {1: 20.0, 2: 39.0}, [1, 2]) == 2


def test_choose_budget_names_a_missing_or_bad_step_time():
    with pytest.raises(BudgetError, match="no entry for budget 4"):
        choose_budget([1.0] * 9, {1: 5.0}, [1, 4])
    with pytest.raises(BudgetError, match=r"step_time_us\[1\] must be a positive"):
        choose_budget([1.0, 2.0], {1: 0.0}, [1])
