"""Chained norms (description/layers.py chained_norms, stack.target_forward(chain_norms=True); issue 48): each
layer's closing residual add and the next layer's input norm as the MLP all-reduce's fused add + norm, the normed
x handed to the next layer. On the numpy ranks every op is the unchained layer's, so the logits, the taps and the
caches must be bitwise the unchained forward's; the x a layer is fed must be its own input norm of its h (its own
weight: the tiny model's norms differ by layer, so a neighbour's weight would move the logits)."""
import numpy as np
import pytest

from ddtree.builder.build import build_engine
from ddtree.data import tiny_model_dirs
from ddtree.description import layers, stack
from ddtree.reference.model import causal_visible
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.tree.build import pack_visibility

TAPS = (1, 2)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def executor(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"chain{request.param}") / "engine"
    return EngineExecutor(build_engine(*tiny_model_dirs(), request.param, [], out, graphs=False,
                                       kernels=False)["engine"])


def forward(ex, chain: bool, ids, pos, visible, cache, head=(layers.head, ())):
    """stack.target_forward on the numpy ranks -> (the head's per-rank outputs, taps, {layer: (args, feeds, output
    names)} as called)."""
    T = cache.length
    cache.reserve(T + len(ids))
    feeds = {"ids": ids.astype(np.int32), "pos": pos.astype(np.int32), "cache_len": np.array([T], np.int32),
             "tree_mask": pack_visibility(visible[:, T:]).view(np.int32)}
    head_feeds = None if head is None else {"sample_pos": feeds["pos"] + 1, "temperature": np.zeros(1, np.float32),
                                             "seed": np.zeros(2, np.int32)}
    called, tapped = {}, {}

    def run(kind, fn, args, feeds, layer=None):
        outs = ex.run(kind, fn, args, feeds, layer)
        if fn is layers.decoder_layer:
            called[layer] = (args, feeds, set(outs))
        return outs
    outs = stack.target_forward(run, ex.config, ex.moe_inter, feeds, cache, TAPS,
                                lambda L, h: tapped.__setitem__(L, [r.copy() for r in h]), head=head,
                                head_feeds=head_feeds, chain_norms=chain)
    cache.length = T + len(ids)
    return outs, tapped, called


def test_chained_norms_are_the_unchained_layers(executor):
    cfg, rng = executor.config, np.random.default_rng(5)
    prompt = rng.integers(0, cfg.vocab_size, 9)
    tree_ids, parents = rng.integers(0, cfg.vocab_size, 6), [-1, 0, 0, 1, 1, 2]
    results = {}
    for chain in (False, True):
        cache = executor.new_target_cache(16, 64)
        first = forward(executor, chain, prompt, np.arange(9), causal_visible(0, 9), cache)
        vis = np.zeros((6, 15), bool)                                      # the prompt and each node's ancestors
        vis[:, :9] = True
        for i, p in enumerate(parents):
            vis[i, 9 + i] = True
            while p >= 0:
                vis[i, 9 + p], p = True, parents[p]
        second = forward(executor, chain, tree_ids, 9 + np.array([0, 1, 1, 2, 2, 2]), vis, cache)
        results[chain] = (first, second, [cache.entries(L, rank=r) for L in range(cfg.num_hidden_layers)
                                         for r in range(executor.held)])
    last = cfg.num_hidden_layers - 1
    for (plain, chained) in zip(results[False][:2], results[True][:2]):
        (outs_p, taps_p, called_p), (outs_c, taps_c, called_c) = plain, chained
        for name in ("logits", "win_value", "win_id"):
            assert all(np.array_equal(a, b) for a, b in zip(outs_p[name], outs_c[name])), name
        assert sorted(taps_c) == list(TAPS) and all(np.array_equal(a, b) for L in TAPS
                                                    for a, b in zip(taps_p[L], taps_c[L]))
        assert all("x" not in feeds for _, feeds, _ in called_p.values())
        for L, (args, feeds, _) in called_c.items():
            assert ("x" in feeds) == (L > 0), f"layer {L}: x fed {('x' in feeds)}"
            assert args[-1] is True and layers.chained_norms(cfg, L) == (L > 0, L < last)
            if L > 0:                                                      # its own input norm of its own h
                for r, (ops, x, h) in enumerate(zip(executor.ranks.ranks, feeds["x"], feeds["h"])):
                    own = ops.rms_norm(h, ops.weights[f"model.layers.{L}.input_layernorm.weight"], cfg.rms_norm_eps)
                    assert np.array_equal(x, own), f"layer {L} rank {r}: x is not its own input norm of h"
    assert all(np.array_equal(a, b) for a, b in zip(results[False][2], results[True][2]))


def test_the_last_layer_leaves_its_norm_to_the_head(executor):
    """No x_out past the last layer (the head norms h with model.norm), none from an unchained layer."""
    last = executor.config.num_hidden_layers - 1
    for chain in (False, True):
        _, _, called = forward(executor, chain, np.arange(3), np.arange(3), causal_visible(0, 3),
                               executor.new_target_cache(16, 64), head=None)
        assert sorted(called) == list(range(last + 1))
        assert all(("x_out" in names) == (chain and L < last) for L, (_, _, names) in called.items())
