"""Tree builder vs brute-force enumeration of every prefix; visibility bits vs ancestor sets."""
import itertools

import numpy as np
import pytest

from ddtree.tree.build import build_tree, pack_visibility, topk_logprobs, unpack_visibility
from ddtree.tree.walk import accept_walk


def brute_force_top_prefixes(logp, budget):
    """Every rank tuple up to depth D, scored parent-then-child in fp32, sorted (-score, tuple)."""
    D, k = logp.shape
    score = {(): np.float32(0)}
    for d in range(1, D + 1):
        for rt in itertools.product(range(k), repeat=d):
            score[rt] = np.float32(score[rt[:-1]] + logp[d - 1, rt[-1]])
    cands = sorted((rt for rt in score if rt), key=lambda rt: (-float(score[rt]), rt))
    return cands[:budget], score


def random_table(rng, D, k, ties=False):
    x = rng.standard_normal((D, 40)).astype(np.float32)
    if ties:   # quantised logits make exact score ties common, between siblings and across depths
        x = np.round(x * 2) / 2
    return topk_logprobs(x, k)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("budget", [1, 2, 7, 16, 40])
def test_builder_matches_brute_force(seed, budget):
    rng = np.random.default_rng(seed)
    D, k = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    logp, ids = random_table(rng, D, k, ties=seed % 2 == 0)
    tree = build_tree(99, logp, ids, budget)
    want, score = brute_force_top_prefixes(logp, budget)
    assert tree.ranks[1:] == want                                   # same nodes, same order
    assert tree.tokens[0] == 99 and tree.parents[0] == -1 and tree.depth[0] == 0
    index = {rt: i for i, rt in enumerate(tree.ranks)}
    for i in range(1, tree.size):
        rt = tree.ranks[i]
        assert rt[:-1] in index                                     # prefix-closed
        assert tree.parents[i] == index[rt[:-1]] < i                # parent < child
        assert tree.depth[i] == len(rt)
        assert tree.tokens[i] == ids[len(rt) - 1, rt[-1]]
        assert tree.scores[i] == score[rt]


def test_exact_ties_prefer_lexicographically_smaller_rank_tuple():
    # uniform drafter: every depth-1 node scores log(1/3); children score lower
    logp = np.full((2, 3), np.float32(np.log(1 / 3)), np.float32)
    ids = np.array([[5, 6, 7], [8, 9, 10]], np.int32)
    tree = build_tree(0, logp, ids, 6)
    assert tree.ranks[1:] == [(0,), (1,), (2,), (0, 0), (0, 1), (0, 2)]


def test_topk_ties_go_to_lower_id():
    logits = np.array([[1.0, 3.0, 3.0, 0.0, 3.0]], np.float32)
    logp, ids = topk_logprobs(logits, 4)
    assert ids.tolist() == [[1, 2, 4, 0]]
    ref = logits[0] - np.log(np.exp(logits[0].astype(np.float64)).sum())
    np.testing.assert_allclose(logp[0], ref[[1, 2, 4, 0]], rtol=1e-6)


def test_visibility_bits_are_ancestor_sets():
    rng = np.random.default_rng(3)
    logp, ids = random_table(rng, 7, 6)
    tree = build_tree(1, logp, ids, 70)          # > 64 nodes: three words per row
    words = tree.visibility_bits()
    assert words.shape == (71, 3) and words.dtype == np.uint32
    for i in range(tree.size):
        anc, j = {i}, i
        while tree.parents[j] >= 0:
            j = int(tree.parents[j])
            anc.add(j)
        row = {j for j in range(tree.size) if (words[i][j >> 5] >> (j & 31)) & 1}
        assert row == anc
    assert np.array_equal(unpack_visibility(words, tree.size), tree.visible())
    assert np.array_equal(pack_visibility(tree.visible()), words)


def test_walk_follows_matching_children():
    logp = np.log(np.full((3, 2), 0.5, np.float32))
    ids = np.array([[10, 11], [20, 21], [30, 31]], np.int32)
    tree = build_tree(1, logp, ids, 14)          # complete binary tree of depth 3
    # the target says 11, then 20, then 99 (matches no child)
    y = np.full(tree.size, 99)
    n11 = tree.children()[0][11]
    n20 = tree.children()[n11][20]
    y[0], y[n11] = 11, 20
    r = accept_walk(tree, y)
    assert r.accepted.tolist() == [0, n11, n20] and r.bonus == 99
    assert np.all(np.diff(r.accepted) > 0)


def test_budget_bounds():
    logp, ids = topk_logprobs(np.zeros((2, 4), np.float32), 2)
    with pytest.raises(ValueError, match="budget 0"):
        build_tree(0, logp, ids, 0)
    with pytest.raises(ValueError, match="budget 256"):
        build_tree(0, logp, ids, 256)
    assert build_tree(0, logp, ids, 255).size == 1 + 2 + 4      # fewer nodes once every prefix is taken
