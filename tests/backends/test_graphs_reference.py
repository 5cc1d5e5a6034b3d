"""The per-rank ONNX graphs, run by onnx.reference with the ranks in threads and AllReduce summing
across them, compute what the float64 reference computes: target prefill and tree verify (logits,
taps, latent cache), the drafter, and the tree build / acceptance walk of a DDTree step.

The graphs carry float attributes as float32 (ONNX and the plugin fields store them so), so they
match exactly (1e-12) the reference run with the same float32 constants (routed_scaling_factor,
the MLA softmax scale), and the plain reference to ~1e-7."""
import numpy as np
import pytest

from ddtree.reference.model import causal_visible
from ddtree.runtime import vocab_parallel
from ddtree.runtime.graph_ranks import GraphRanks, mask_words
from ddtree.tree.build import Tree, build_tree
from ddtree.tree.sampling import SamplingParams
from ddtree.tree.walk import accept_walk, sample_positions

ENGINES = [("tiny", 1, "tp"), ("tiny", 2, "tp"), ("tiny", 4, "tp"), ("tiny-grouped", 2, "ep")]
IDS = [f"{p}-tp{t}-{e}" for p, t, e in ENGINES]
EXACT, F32_ATTRS = 1e-12, 1e-6
PROMPT = np.array([256] + list(b"def fib(n): return"))
TREE_TOKENS = np.array([33, 10, 65, 66, 67, 68, 69, 70, 259])
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 6]


def close(got, want, rtol):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


def ancestors(parents) -> np.ndarray:
    """[q, q] bool: node i sees itself and its ancestors."""
    vis = np.eye(len(parents), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            vis[i] |= vis[p]
    return vis




@pytest.fixture(scope="module")
def ranks(engine):
    made = {}

    def get(key):
        if key not in made:
            made[key] = GraphRanks.from_engine(engine(*key), act="float64")
        return made[key]
    return get


def split(logits, g: GraphRanks):
    V_r = logits.shape[1] // g.tp
    return [logits[:, r * V_r: (r + 1) * V_r] for r in range(g.tp)], [r * V_r for r in range(g.tp)]


@pytest.mark.parametrize("key", ENGINES, ids=IDS)
def test_target_prefill_and_tree_verify_match_reference(ranks, oracles, key):
    g = ranks(key)
    target, target32, _ = oracles(key[0])
    taps = (0, 1, 2)
    P = len(PROMPT)
    caches, ref_cache, ref32_cache = g.new_target_caches(64), target.new_cache(), target32.new_cache()
    causal = causal_visible(0, P)
    got = g.target_forward(PROMPT, np.arange(P), mask_words(causal), caches, taps)
    want32, want32_taps = target32.forward(PROMPT, np.arange(P), causal, ref32_cache, taps)
    want, want_taps = target.forward(PROMPT, np.arange(P), causal, ref_cache, taps)
    assert got.logits.shape == (P, target.config.vocab_size)
    close(got.logits, want32, EXACT)
    close(got.logits, want, F32_ATTRS)
    for L in taps:
        close(got.taps[L], want32_taps[L], EXACT)
        close(got.taps[L], want_taps[L], F32_ATTRS)
    # a DDTree verify step: the nodes at P + depth see the whole cache plus their ancestors
    pos = Tree.from_parents(TREE_PARENTS).positions(P)
    tree_vis = ancestors(TREE_PARENTS)
    visible = np.concatenate([np.ones((len(pos), P), bool), tree_vis], axis=1)
    got = g.target_forward(TREE_TOKENS, pos, mask_words(tree_vis), caches, taps)
    want32, want32_taps = target32.forward(TREE_TOKENS, pos, visible, ref32_cache, taps)
    close(got.logits, want32, EXACT)
    close(got.logits, target.forward(TREE_TOKENS, pos, visible, ref_cache)[0], F32_ATTRS)
    for L in taps:
        close(got.taps[L], want32_taps[L], EXACT)
    # the replicated latent cache: every rank holds the reference's entries
    assert caches.length == ref32_cache.length == P + len(TREE_TOKENS)
    for rank_layers in caches.layers:
        for L, layer_cache in enumerate(rank_layers):
            close(layer_cache[: caches.length], ref32_cache.entries(L), EXACT)


@pytest.mark.parametrize("key", ENGINES, ids=IDS)
def test_drafter_graphs_match_reference(ranks, oracles, key):
    g = ranks(key)
    _, _, drafter = oracles(key[0])
    d = drafter.config
    rng = np.random.default_rng(3)
    ref_cache, caches = drafter.new_cache(), g.new_drafter_caches(64)
    start = 0
    for n in (5, 2, 0, 3):                                   # context tokens committed before each block
        ctx = rng.standard_normal((n, d.num_taps * d.hidden_size))
        start += n
        block = np.array([int(rng.integers(0, 256))] + [d.mask_token_id] * (d.block_size - 1))
        pos = np.arange(start, start + d.block_size)
        want = drafter.forward(block, pos, ctx, ref_cache)
        got = g.drafter_forward(block, pos, ctx, caches)
        close(got.logits, want, EXACT)
        assert caches.length == ref_cache.length == start


@pytest.mark.parametrize("key", ENGINES, ids=IDS)
def test_ddtree_step_through_graphs(ranks, oracles, key):
    """Draft -> tree_b<B> -> verify -> accept on the graphs equals the executor primitives (vocab-parallel
    top-k, tree/build, the sampling definition, tree/walk) applied to the graphs' own logits."""
    g = ranks(key)
    target32 = oracles(key[0])[1]
    d = g.dcfg
    P = len(PROMPT)
    caches = g.new_target_caches(128)
    pre = g.target_forward(PROMPT, np.arange(P), mask_words(causal_visible(0, P)), caches, d.target_layer_ids)
    bonus = int(pre.logits[-1].argmax())
    taps = np.concatenate([pre.taps[L] for L in d.target_layer_ids], axis=1)         # [P, K H]
    draft = g.drafter_forward([bonus] + [d.mask_token_id] * (d.block_size - 1), np.arange(P, P + d.block_size),
                              taps, g.new_drafter_caches(128))
    local, offsets = split(draft.logits, g)
    budgets = sorted(int(kind[len("tree_b"):]) for kind in g.graphs[0] if kind.startswith("tree_b"))
    assert budgets == [16, 32, 64]
    for budget in budgets:
        tree = g.tree_build(bonus, draft.candidates, budget)
        want = build_tree(bonus, *vocab_parallel.topk_logprobs(local, offsets, budget), budget)
        for name in ("tokens", "parents", "depth"):
            np.testing.assert_array_equal(tree[name], getattr(want, name))
        np.testing.assert_array_equal(tree["visibility"].view(np.uint32), want.visibility_bits())
    # verify the last (largest) tree and walk it, greedy and sampled
    for params in (SamplingParams(), SamplingParams(temperature=0.75, seed=2**33 + 5)):
        verify_caches = caches.copy()
        pos = P + want.depth.astype(np.int64)
        out = g.target_forward(want.tokens, pos, tree["visibility"], verify_caches, temperature=params.temperature,
                               seed=params.seed)
        visible = np.concatenate([np.ones((len(pos), P), bool), want.visible()], axis=1)
        ref32_cache = target32.new_cache(128)
        target32.forward(PROMPT, np.arange(P), causal_visible(0, P), ref32_cache)
        close(out.logits, target32.forward(want.tokens, pos, visible, ref32_cache)[0], EXACT)
        walk = g.accept(tree["tokens"], tree["parents"], out.winners)
        sampled = vocab_parallel.sample(*split(out.logits, g), sample_positions(want, P), params)
        np.testing.assert_array_equal(walk["target_tokens"], sampled)
        ref_walk = accept_walk(want, sampled)
        n = int(walk["accepted_count"][0])
        np.testing.assert_array_equal(walk["accepted"][:n], ref_walk.accepted)
        assert (walk["accepted"][n:] == -1).all() and int(walk["bonus"][0]) == ref_walk.bonus
        # keep a path of the verify in the cache (the compact graph) == the reference cache compacted;
        # a fixed deep path, since a random synthetic target rarely accepts past the root
        keep = np.array([0, 3, 7, 12] + [-1] * (len(pos) - 4), np.int32)
        g.compact(verify_caches, P, keep, 4)
        ref32_cache.compact(P, keep[:4])
        assert verify_caches.length == ref32_cache.length == P + 4
        for r in range(g.tp):
            for L in range(g.cfg.num_hidden_layers):
                close(verify_caches.entries(L, rank=r), ref32_cache.entries(L), EXACT)


def test_engine_graphs_in_bf16_run_close_to_reference(engine, oracles):
    """The engine's own graphs/ (bfloat16 activations, what the plans are built from) under
    onnx.reference: within bf16 rounding of the reference, away from MoE routing near-ties."""
    g = GraphRanks.from_engine(engine("tiny", 2))
    assert g.act == "bfloat16"
    target, _, drafter = oracles("tiny")
    P = len(PROMPT)
    got = g.target_forward(PROMPT, np.arange(P), mask_words(causal_visible(0, P)), g.new_target_caches(64), (0, 1))
    want, want_taps = target.forward(PROMPT, np.arange(P), causal_visible(0, P), target.new_cache(), (0, 1))
    rel = lambda a, b: np.abs(a.astype(np.float64) - b).max(axis=-1) / np.abs(b).max()   # noqa: E731  per row
    assert rel(got.taps[0], want_taps[0]).max() < 2e-2                      # dense layer 0: no routing
    assert np.median(rel(got.taps[1], want_taps[1])) < 2e-2                 # MoE: a bf16 near-tie can flip a row
    assert (got.logits.astype(np.float64).argmax(1) == want.argmax(1)).mean() > 0.7
    d = drafter.config
    block = np.array([65] + [d.mask_token_id] * (d.block_size - 1))
    ctx = np.random.default_rng(0).standard_normal((4, d.num_taps * d.hidden_size))
    dgot = g.drafter_forward(block, np.arange(4, 4 + d.block_size), ctx, g.new_drafter_caches(64))
    dwant = drafter.forward(block, np.arange(4, 4 + d.block_size), ctx, drafter.new_cache())
    assert rel(dgot.logits, dwant).max() < 3e-2
