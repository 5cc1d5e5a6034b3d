"""The tree pruning rule (tree/prune.py) against an independent brute force on small random trees and routings,
hand-made edge cases (nothing pruned, all but the root pruned, chains, a shared expert keeps a node, a dropped
node takes its subtree), bad input named, the path probabilities against a product written out per path, and the
walk of a pruned tree never entering a dead node."""
import numpy as np
import pytest

from ddtree.tree.budget import Calibration
from ddtree.tree.build import Tree, build_tree, topk_logprobs
from ddtree.tree.prune import DEFAULT_RATE, PruneError, absent_tree, exchange_rate, node_path_probs, prune_nodes
from ddtree.tree.walk import accept_walk
from tests.tree.prune_cases import cases


def brute_force(live, parents, prob, ids, expert_bytes, rate, horizon) -> np.ndarray:
    """Sets instead of counts, an ancestor walk instead of the forward pass, in float64 as the rule states (the
    bytes a node would still cost: python's exact integer product over the MoE layers left)."""
    q = len(live)
    alive = [i == 0 or bool(live[i]) for i in range(q)]
    experts = [set(int(e) for e in ids[i]) for i in range(q)]
    dropped = set()
    for i in range(1, q):
        if not alive[i]:
            continue
        others = set().union(*(experts[j] for j in range(q) if alive[j] and j != i))
        marginal = len(experts[i] - others)
        if marginal and float(prob[i]) < float(np.float32(rate)) * float(marginal * expert_bytes * horizon):
            dropped.add(i)
    out = np.zeros(q, np.int32)
    for i in range(q):
        j, ok = i, alive[i]
        while ok and j >= 0:                      # i and every ancestor live and kept
            ok = alive[j] and j not in dropped
            j = int(parents[j])
        out[i] = ok
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rule_equals_brute_force(seed):
    some, by_horizon = 0, 0
    for case, bytes_, rate, horizon in cases(seed):
        got = prune_nodes(case["live"], case["parents"], case["path_prob"], case["routed_ids"], bytes_, rate, 64,
                          horizon=horizon)
        want = brute_force(case["live"], case["parents"], case["path_prob"], case["routed_ids"], bytes_, rate, horizon)
        assert got.tolist() == want.tolist(), (case, bytes_, rate, horizon)
        some += 0 < int((case["live"] != got).sum()) < int(case["live"].sum()) - 1
        one = prune_nodes(case["live"], case["parents"], case["path_prob"], case["routed_ids"], bytes_, rate, 64)
        by_horizon += horizon > 1 and one.tolist() != got.tolist()
        assert np.all(got <= one)                 # a longer horizon only ever drops more
    assert some > 10                              # the cases prune some nodes, not only none or all
    assert by_horizon > 5                         # and the horizon decides some of them


def test_edge_cases_by_hand():
    parents = np.array([-1, 0, 0, 1, 3], np.int32)        # 0 -> 1 -> 3 -> 4 and 0 -> 2
    prob = np.array([1, .9, .5, .3, .01], np.float32)
    ids = np.array([[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]], np.int32)   # every expert used once: all marginal
    live = np.ones(5, np.int32)
    assert prune_nodes(live, parents, prob, ids, 100, 0.0).tolist() == [1, 1, 1, 1, 1]        # rate 0: nothing
    assert prune_nodes(live, parents, prob, ids, 100, 1.0).tolist() == [1, 0, 0, 0, 0]        # all but the root
    # threshold 2 experts x 100 bytes x 1e-3 = 0.2: node 4 (.01) goes; node 3 (.3) stays
    assert prune_nodes(live, parents, prob, ids, 100, 1e-3).tolist() == [1, 1, 1, 1, 0]
    # 0.5 x 2 x 100 ... rate 2e-3 -> threshold .4: node 3 drops and takes node 4 with it
    assert prune_nodes(live, parents, prob, ids, 100, 2e-3).tolist() == [1, 1, 1, 0, 0]
    # the horizon multiplies the bytes: node 3 (.3) stays at threshold .2 for one layer, goes at .4 for two, .6 three
    assert prune_nodes(live, parents, prob, ids, 100, 1e-3, horizon=2).tolist() == [1, 1, 1, 0, 0]
    assert prune_nodes(live, parents, prob, ids, 100, 1e-3, horizon=3).tolist() == [1, 1, 0, 0, 0]   # .5 < .6
    assert prune_nodes(live, parents, prob, ids, 100, 1e-3, horizon=5).tolist() == [1, 0, 0, 0, 0]   # .9 < 1.0
    shared = ids.copy()
    shared[3] = [0, 1]                                     # node 3 uses the root's experts: no marginal, kept
    assert prune_nodes(live, parents, prob, shared, 100, 1.0).tolist() == [1, 0, 0, 0, 0]    # its parent went
    shared[1] = [0, 1]
    assert prune_nodes(live, parents, prob, shared, 100, 1.0).tolist() == [1, 1, 0, 1, 0]
    # a dead node's experts do not count: nodes 1 and 2 share expert 4 (nothing marginal, all kept); with node 2
    # dead, node 1's expert 4 becomes marginal and node 1 goes, with 3 and 4
    ids2 = np.array([[0, 1], [0, 4], [4, 1], [0, 1], [1, 0]], np.int32)
    assert prune_nodes(live, parents, prob, ids2, 100, 1.0).tolist() == [1, 1, 1, 1, 1]
    assert prune_nodes([1, 1, 0, 1, 1], parents, prob, ids2, 100, 1.0).tolist() == [1, 0, 0, 0, 0]


def test_bad_input_is_named():
    ok = dict(live=[1, 1], parents=[-1, 0], path_prob=[1, .5], routed_ids=[[0], [1]])
    with pytest.raises(PruneError, match="parents"):
        prune_nodes(ok["live"], [-1, 1], ok["path_prob"], ok["routed_ids"], 1, 1.0)
    with pytest.raises(PruneError, match="routed_ids"):
        prune_nodes(ok["live"], ok["parents"], ok["path_prob"], [[0], [9]], 1, 1.0, n_experts=8)
    with pytest.raises(PruneError, match=r"\[q\]"):
        prune_nodes(ok["live"], ok["parents"], [1.0], ok["routed_ids"], 1, 1.0)
    for bad in (-1, 1025, 2.0, None):
        with pytest.raises(PruneError, match="horizon"):
            prune_nodes(ok["live"], ok["parents"], ok["path_prob"], ok["routed_ids"], 1, 1.0, horizon=bad)


def test_path_probs_are_the_calibrated_products_along_each_path():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 20)) * 3
    logp, ids = topk_logprobs(logits, 8)
    tree = build_tree(5, logp, ids, 8)
    soft = np.exp(logits - logits.max(1, keepdims=True))
    soft /= soft.sum(1, keepdims=True)
    cal = Calibration((None, {"x": [0.0, 1.0], "y": [0.0, 0.5], "samples": 9}), {"x": [0.0, 1.0], "y": [0.2, 0.9],
                                                                                 "samples": 9})
    for calibration in (None, cal):
        got = node_path_probs(tree.parents, tree.depth, tree.tokens, logits, calibration)
        for i in range(tree.size):
            want, j = 1.0, i
            while j > 0:
                p = soft[tree.depth[j] - 1, tree.tokens[j]]
                want *= p if calibration is None else calibration.calibrate(p, tree.depth[j])
                j = tree.parents[j]
            assert got[i] == pytest.approx(want, rel=1e-6)
    assert got[0] == 1.0


def test_the_walk_never_enters_a_dead_node():
    tree = Tree.from_parents([-1, 0, 0, 1, 2], [7, 3, 4, 5, 6])
    target = np.array([3, 5, 6, 9, 9])                     # the target follows 0 -> 1 -> 3
    assert accept_walk(tree, target).accepted.tolist() == [0, 1, 3]
    walk = accept_walk(absent_tree(tree, [1, 1, 1, 0, 1]), target)
    assert walk.accepted.tolist() == [0, 1] and walk.bonus == 5    # node 3 absent: the walk stops at 1
    assert accept_walk(absent_tree(tree, [1, 0, 1, 0, 1]), target).accepted.tolist() == [0]
    with pytest.raises(PruneError, match="root"):
        absent_tree(tree, [0, 1, 1, 1, 1])


def test_default_rate_is_its_stated_derivation():
    # 5 tokens per 14920 us step, 8600 us for 116 x 60 expert reads of 3,096,576 bytes each
    assert DEFAULT_RATE == pytest.approx(5.0 / 14920.0 * (8600.0 / (116 * 60)) / 3_096_576, rel=1e-12)
    assert 1e-10 < DEFAULT_RATE < 2e-10


def test_exchange_rate_from_a_tuning_file():
    from ddtree.engine_dir.tuning import Tuning, now_utc
    t = Tuning("hand-made", now_utc(), (4, 16), (1024, 8192), ((100.0, 200.0), (160.0, 300.0)), (10.0, 40.0),
               Calibration.identity())
    # slope at context 1024: (160 - 100) us / ((40 - 10) experts x 3 layers) = 2/3 us per expert read
    assert exchange_rate(t, 16, 1000, 4.0, 3, 500) == pytest.approx(4.0 / 160.0 * (60.0 / 90.0) / 500, rel=1e-12)
    assert exchange_rate(t, 4, 5000, 2.0, 3, 500) == pytest.approx(2.0 / 200.0 * (100.0 / 90.0) / 500, rel=1e-12)
    flat = Tuning("hand-made", now_utc(), (4, 16), (1024,), ((100.0,), (160.0,)), (0.0, 0.0), Calibration.identity())
    one = Tuning("hand-made", now_utc(), (16,), (1024,), ((160.0,),), (40.0,), Calibration.identity())
    assert exchange_rate(flat, 16, 1000, 4.0, 3, 500) is None and exchange_rate(one, 16, 1000, 4.0, 3, 500) is None


def test_expected_saving_counts_the_experts_only_dropped_nodes_used_times_the_layers_after():
    """tree/prune.py expected_saving against a brute force over experts: at each pruning MoE layer, an expert counts
    when some node live there uses it and no node still live after the layer does; it is charged the MoE layers
    after that one. Three MoE layers (pruning at 0 and 1), four nodes, top 2."""
    from ddtree.tree.prune import expected_saving
    routed = np.array([[[0, 1], [2, 3], [1, 4], [5, 6]],      # layer 0: node 3 alone uses 5, 6; node 2 alone uses 4
                       [[0, 1], [2, 3], [7, 7], [9, 9]],      # layer 1: node 2 is dropped here (7 is only its)
                       [[0, 1], [2, 3], [8, 8], [9, 9]]])
    lives = np.array([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    final = np.array([1, 1, 0, 0])

    def brute(at):
        total = 0
        for j in at:
            after = lives[j + 1] if j + 1 < 3 else final
            for e in range(10):
                used = any(e in routed[j][i] for i in range(4) if lives[j][i])
                kept = any(e in routed[j][i] for i in range(4) if lives[j][i] and after[i])
                total += (used and not kept) * (3 - j - 1)
        return total
    assert expected_saving(routed, lives, final, {0: 2}) == brute((0,)) == 2 * 2        # 5, 6 for two layers
    assert expected_saving(routed, lives, final, {0: 2, 1: 1}) == brute((0, 1)) == 4 + 1  # + 7 for one layer
    assert expected_saving(routed, lives, final, {2: 0}) == 0                           # no layer after the last
