"""The reference forward and latent cache (docs/interfaces.md section 3): naive == absorbed MLA,
prefill-then-decode == one-shot, tree visibility == per-path causal forwards, cache.compact."""
import numpy as np
import pytest

from ddtree.reference.layers import rms_norm
from ddtree.reference.model import causal_visible

RTOL = 1e-12
PROMPT = np.array([256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100])   # BOS "Hello, world"
# a small DDTree-shaped tree hung below the prompt: node 0 is the root, parents[i] < i
TREE_TOKENS = np.array([33, 10, 65, 66, 67, 68, 69, 70])
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3]


def close(a, b, rtol=RTOL):
    """rtol relative to the tensor's scale (a few entries sit near zero)."""
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())


def tree_paths(parents):
    paths = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
    return paths


def tree_visible(T, parents):
    q = len(parents)
    visible = np.zeros((q, T + q), dtype=bool)
    visible[:, :T] = True
    for i, path in enumerate(tree_paths(parents)):
        visible[i, [T + j for j in path]] = True
    return visible


def prefill(target, ids, taps=()):
    cache = target.new_cache()
    logits, tapped = target.forward(ids, np.arange(len(ids)), causal_visible(0, len(ids)), cache, taps)
    return cache, logits, tapped


@pytest.mark.parametrize("preset", ["tiny", "small-mla"])
def test_naive_equals_absorbed(target, preset):
    t = target(preset)
    ids = np.concatenate([PROMPT, TREE_TOKENS])
    cache_a, logits_a, taps_a = prefill(t, ids, taps=(1, 2))
    cache_n = t.new_cache()
    logits_n, taps_n = t.forward(ids, np.arange(len(ids)), causal_visible(0, len(ids)), cache_n, (1, 2),
                                 naive_mla=True)
    close(logits_n, logits_a)
    close(taps_n[2], taps_a[2])
    # and under a tree mask on top of a cache
    T = len(PROMPT)
    depth = np.array([len(p) - 1 for p in tree_paths(TREE_PARENTS)])
    visible = tree_visible(T, TREE_PARENTS)
    outs = []
    for naive in (False, True):
        cache, _, _ = prefill(t, PROMPT)
        outs.append(t.forward(TREE_TOKENS, T + depth, visible, cache, naive_mla=naive)[0])
    close(outs[1], outs[0])


@pytest.mark.parametrize("preset", ["tiny", "small-mla"])
def test_prefill_then_decode_equals_one_shot(target, preset):
    t = target(preset)
    taps = (0, 2)
    _, logits_all, taps_all = prefill(t, PROMPT, taps)
    cache, logits_pre, taps_pre = prefill(t, PROMPT[:7], taps)
    rows, tapped = [logits_pre], [taps_pre]
    for i in range(7, len(PROMPT)):
        T = cache.length
        lg, tp = t.forward(PROMPT[i:i + 1], np.array([i]), causal_visible(T, 1), cache, taps)
        rows.append(lg)
        tapped.append(tp)
    assert cache.length == len(PROMPT)
    close(np.concatenate(rows), logits_all)
    for L in taps:
        close(np.concatenate([tp[L] for tp in tapped]), taps_all[L])


def test_last_tap_is_the_pre_final_norm_state(target):
    t = target("tiny")
    last = t.config.num_hidden_layers - 1
    _, logits, tapped = prefill(t, PROMPT, taps=(last,))
    close(rms_norm(tapped[last], t.final_norm, t.config.rms_norm_eps) @ t.lm_head.T, logits)


def test_tree_visibility_equals_per_path_causal_forward(target):
    t = target("tiny")
    T = len(PROMPT)
    paths = tree_paths(TREE_PARENTS)
    depth = np.array([len(p) - 1 for p in paths])
    cache, _, _ = prefill(t, PROMPT)
    tree_logits, tree_taps = t.forward(TREE_TOKENS, T + depth, tree_visible(T, TREE_PARENTS), cache, taps=(1,))
    assert cache.length == T + len(TREE_TOKENS)
    for i, path in enumerate(paths):
        _, logits, tapped = prefill(t, np.concatenate([PROMPT, TREE_TOKENS[path]]), taps=(1,))
        close(tree_logits[i], logits[-1])
        close(tree_taps[1][i], tapped[1][-1])


@pytest.mark.parametrize("keep", [[0, 1, 3, 6], [0, 2, 5], [0], []])
def test_compact_leaves_a_fresh_forward_over_the_kept_tokens(target, keep):
    t = target("tiny")
    T = len(PROMPT)
    depth = np.array([len(p) - 1 for p in tree_paths(TREE_PARENTS)])
    cache, _, _ = prefill(t, PROMPT)
    t.forward(TREE_TOKENS, T + depth, tree_visible(T, TREE_PARENTS), cache)
    cache.compact(T, keep)
    assert cache.length == T + len(keep)
    fresh, _, _ = prefill(t, np.concatenate([PROMPT, TREE_TOKENS[keep]]))
    for L in range(t.config.num_hidden_layers):
        close(cache.entries(L), fresh.entries(L))
    # decoding on after the compaction equals a one-shot forward
    nxt = np.array([42])
    got, _ = t.forward(nxt, np.array([cache.length]), causal_visible(cache.length, 1), cache)
    _, want, _ = prefill(t, np.concatenate([PROMPT, TREE_TOKENS[keep], nxt]))
    close(got[0], want[-1])


def test_truncate_then_decode(target):
    t = target("tiny")
    cache, _, _ = prefill(t, PROMPT)
    cache.truncate(5)
    got, _ = t.forward(PROMPT[5:7], np.array([5, 6]), causal_visible(5, 2), cache)
    _, want, _ = prefill(t, PROMPT[:7])
    close(got, want[5:7])


def test_cache_layout_is_normed_c_kv_then_roped_k_pe(target):
    t = target("small-mla")
    cfg = t.config
    cache, _, _ = prefill(t, PROMPT)
    x = rms_norm(t.embed[PROMPT], t.layers[0].input_norm, cfg.rms_norm_eps)
    entries0 = cache.entries(0)
    assert entries0.shape == (len(PROMPT), cfg.kv_lora_rank + cfg.qk_rope_head_dim) == (len(PROMPT), 576)
    a = x @ t.layers[0].attn.kv_a.T
    close(entries0[:, :512], rms_norm(a[:, :512], t.layers[0].attn.kv_a_norm, cfg.rms_norm_eps))
    close(entries0[:, 512:], t.mla.rope.apply(a[:, 512:], np.arange(len(PROMPT))))


def test_compact_and_forward_reject_bad_input(target):
    t = target("tiny")
    cache, _, _ = prefill(t, PROMPT)
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.compact(2, [0, 3, 3])
    with pytest.raises(ValueError, match="below length"):
        cache.compact(10, [0, 5])
    with pytest.raises(ValueError, match=r"visible must be \[q, T \+ q\]"):
        t.forward(PROMPT[:2], np.array([13, 14]), causal_visible(0, 2), cache)
    with pytest.raises(ValueError, match="token ids"):
        t.forward(np.array([t.config.vocab_size]), np.array([13]), causal_visible(13, 1), cache)
    with pytest.raises(ValueError, match="taps"):
        t.forward(PROMPT[:1], np.array([13]), causal_visible(13, 1), cache, taps=(99,))
    assert cache.length == len(PROMPT)
