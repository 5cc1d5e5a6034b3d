"""MoE routing and the MoE block against a brute-force loop over experts (docs/kimi-k2.md 5.4)."""
import math
from dataclasses import replace

import numpy as np
import pytest

from ddtree.model.presets import get_preset
from ddtree.model.routing import route as route_tokens
from ddtree.reference.moe import ExpertWeights, MoEWeights, moe


def route(x, w, cfg):
    return route_tokens(x, w.router, w.bias, cfg)


def brute_route(x_row, router, bias, cfg):
    """One token, plain Python: sigmoid scores, biased choice, group limit, top-k by (-score, id)."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    g = [1.0 / (1.0 + math.exp(-float(np.dot(router[e], x_row)))) for e in range(E)]
    c = [g[e] + float(bias[e]) for e in range(E)]
    allowed = set(range(E))
    if cfg.n_group > 1:
        size = E // cfg.n_group
        group_score = []
        for grp in range(cfg.n_group):
            members = sorted((c[e] for e in range(grp * size, (grp + 1) * size)), reverse=True)
            group_score.append(members[0] + members[1])
        groups = sorted(range(cfg.n_group), key=lambda grp: (-group_score[grp], grp))[: cfg.topk_group]
        allowed = {e for grp in groups for e in range(grp * size, (grp + 1) * size)}
    chosen = sorted(allowed, key=lambda e: (-c[e], e))[:k]
    total = sum(g[e] for e in chosen)
    return chosen, [g[e] / (total + 1e-20) * cfg.routed_scaling_factor for e in chosen]


def random_moe(cfg, rng, bias_scale=0.05):
    E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size

    def expert(inter):
        return ExpertWeights(rng.standard_normal((inter, H)) / np.sqrt(H), rng.standard_normal((inter, H)) / np.sqrt(H),
                             rng.standard_normal((H, inter)) / np.sqrt(inter))

    return MoEWeights(router=rng.standard_normal((E, H)) / np.sqrt(H), bias=bias_scale * rng.standard_normal(E),
                      experts=[expert(I) for _ in range(E)], shared=expert(I * cfg.n_shared_experts))


@pytest.mark.parametrize("preset", ["tiny", "tiny-grouped"])
def test_route_matches_brute_force(preset):
    cfg, _ = get_preset(preset)
    rng = np.random.default_rng(0)
    w = random_moe(cfg, rng, bias_scale=0.3)       # a large bias so selection and weights visibly differ
    x = rng.standard_normal((64, cfg.hidden_size))
    experts, weights = route(x, w, cfg)
    for i in range(len(x)):
        chosen, wts = brute_route(x[i], w.router, w.bias, cfg)
        assert experts[i].tolist() == chosen
        np.testing.assert_allclose(weights[i], wts, rtol=1e-12)


def test_grouped_routing_really_limits_groups():
    cfg, _ = get_preset("tiny-grouped")
    rng = np.random.default_rng(1)
    w = random_moe(cfg, rng)
    x = rng.standard_normal((256, cfg.hidden_size))
    experts, _ = route(x, w, cfg)
    size = cfg.n_routed_experts // cfg.n_group
    groups_used = [len(set((experts[i] // size).tolist())) for i in range(len(x))]
    assert max(groups_used) <= cfg.topk_group
    # without the group limit, plain top-k would pick from more groups for some tokens
    flat = replace(cfg, n_group=1, topk_group=1)
    flat_experts, _ = route(x, w, flat)
    assert (flat_experts != experts).any()


def test_weights_use_unbiased_scores_and_always_scale():
    cfg, _ = get_preset("tiny")
    rng = np.random.default_rng(2)
    w = random_moe(cfg, rng)
    w.bias[:] = 0.0
    w.bias[5] = 10.0                                # expert 5 always selected, first
    x = rng.standard_normal((8, cfg.hidden_size))
    experts, weights = route(x, w, cfg)
    assert (experts[:, 0] == 5).all()
    g = 1 / (1 + np.exp(-(x @ w.router.T)))
    picked = np.take_along_axis(g, experts, axis=1)
    np.testing.assert_allclose(weights, picked / picked.sum(1, keepdims=True) * cfg.routed_scaling_factor,
                               rtol=1e-12)
    np.testing.assert_allclose(weights.sum(1), cfg.routed_scaling_factor, rtol=1e-12)


def test_ties_pick_the_lowest_expert_id():
    cfg, _ = get_preset("tiny")                     # 8 experts, top-2
    w = random_moe(cfg, np.random.default_rng(3))
    w.router[:] = 0.0                               # every score is sigmoid(0) = 0.5
    w.bias[:] = [0.0, 0.1, 0.0, 0.1, 0.1, 0.0, 0.0, 0.0]
    experts, weights = route(np.ones((3, cfg.hidden_size)), w, cfg)
    assert experts.tolist() == [[1, 3]] * 3         # three-way tie at 0.6 among 1, 3, 4: lowest two
    np.testing.assert_allclose(weights, cfg.routed_scaling_factor / 2, rtol=1e-15)
    w.bias[:] = 0.0
    assert route(np.ones((1, cfg.hidden_size)), w, cfg)[0].tolist() == [[0, 1]]


def test_group_ties_pick_the_lowest_group_id():
    cfg, _ = get_preset("tiny-grouped")             # 16 experts, 4 groups of 4, keep 2 groups, top-4
    w = random_moe(cfg, np.random.default_rng(4))
    w.router[:] = 0.0
    w.bias[:] = 0.0
    w.bias[[2, 3, 9, 10, 13, 14]] = 0.2             # groups 0, 2, 3 tie at 1.4; group 1 scores 1.0
    w.bias[12] = 0.1                                # a strong 3rd member does not count (top-2 sum only)
    experts, _ = route(np.ones((1, cfg.hidden_size)), w, cfg)
    # groups 0 and 2 kept (lowest ids among the tie); best four: 2, 3, 9, 10
    assert experts.tolist() == [[2, 3, 9, 10]]
    w.bias[:] = 0.0                                 # all tie: groups 0 and 1, experts 0..3
    assert route(np.ones((1, cfg.hidden_size)), w, cfg)[0].tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("preset", ["tiny", "tiny-grouped"])
def test_moe_block_matches_per_token_expert_loop(preset):
    cfg, _ = get_preset(preset)
    rng = np.random.default_rng(5)
    w = random_moe(cfg, rng)
    x = rng.standard_normal((16, cfg.hidden_size))
    got = moe(x, w, cfg)

    def run(ew, v):
        a = ew.gate @ v
        return ew.down @ (a / (1 + np.exp(-a)) * (ew.up @ v))

    for i in range(len(x)):
        chosen, wts = brute_route(x[i], w.router, w.bias, cfg)
        want = sum(wt * run(w.experts[e], x[i]) for e, wt in zip(chosen, wts)) + run(w.shared, x[i])
        np.testing.assert_allclose(got[i], want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
