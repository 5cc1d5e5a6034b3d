"""GPU tests of the tree build, the sampler and the acceptance walk against ddtree/tree/ (the spec).

Build: from a given [D, K] table the GPU tree equals build_tree bit for bit (tokens, parents, depth,
positions, fp32 scores, visibility words) over 150 random cases including exact score ties (quarter
tables), all-equal rows and -inf tails; the same table split into several lists merges to the same tree.
Top-k from raw logits: ids equal to topk_logprobs, log-probabilities within 2e-5 (fp32 normaliser order).
Sampling: tokens equal to sampling.sample in every mode (greedy, Gumbel, top-k, top-p on the certified
and the full-row paths, both), with constructed exact ties and seeds above 2^32. Walk: accepted nodes,
count and bonus equal to walk.accept_walk on trees steered to accept deeply. A captured graph replays
the whole step with new device-side inputs.
"""
import numpy as np
import pytest
import tree_cases as tc

from ddtree.tree.build import Tree, build_tree, pack_visibility, topk_logprobs
from ddtree.tree.sampling import SamplingParams, sample
from ddtree.tree.walk import accept_walk

pytestmark = pytest.mark.gpu
V_BIG = 163840


@pytest.fixture(scope="module")
def builders(gpu):
    from ddtree.plugins.tree_build import DraftTreeBuilder
    cache = {}

    def get(D, V=V_BIG, candidates=None):
        if (D, V, candidates) not in cache:
            cache[(D, V, candidates)] = DraftTreeBuilder(gpu, vocab=V, depth=D, candidates=candidates)
        return cache[(D, V, candidates)]
    return get


def scalar(gpu, v):
    return gpu.upload(np.array([v], np.int32))


def assert_tree_equal(out: dict, ref: Tree, start: int, budget: int, what: str):
    n = ref.size
    assert int(out["count"][0]) == n, what
    np.testing.assert_array_equal(out["tokens"][:n], ref.tokens, err_msg=what)
    np.testing.assert_array_equal(out["parents"][:n], ref.parents, err_msg=what)
    np.testing.assert_array_equal(out["depth"][:n], ref.depth, err_msg=what)
    np.testing.assert_array_equal(out["positions"][:n], start + ref.depth, err_msg=what)
    np.testing.assert_array_equal(out["scores"][:n].view(np.uint32), ref.scores.view(np.uint32), err_msg=what)
    vis = np.zeros((budget + 1, (budget + 32) // 32), np.uint32)
    vis[:n, : (n + 31) // 32] = pack_visibility(ref.visible())
    np.testing.assert_array_equal(out["vis"], vis, err_msg=what)
    assert (out["tokens"][n:] == -1).all() and (out["parents"][n:] == -1).all(), what


def build_cases():
    rng = np.random.default_rng(7)
    cases = []
    for i in range(150):
        D = int(rng.choice([1, 2, 3, 7, 7, 15, 16]))
        B = int(rng.choice([1, 2, 5, 16, 64, 64, 200, 255]))
        K = int(min(255, max(1, B if rng.random() < 0.6 else rng.integers(1, 40))))
        cases.append((i, D, K, B, ["smooth", "quarter", "flat", "inf"][i % 4]))
    return cases


def test_build_from_table_is_bitwise_the_numpy_builder(gpu, builders):
    from ddtree.plugins.tree_build import table_keys
    rng = np.random.default_rng(11)
    ties_seen, selected = 0, 0
    for i, D, K, B, kind in build_cases():
        logp, ids = tc.table(rng, D, K, V_BIG, kind)
        root, start = int(rng.integers(0, V_BIG)), int(rng.integers(0, 1 << 20))
        ref = build_tree(root, logp, ids, B)
        ties_seen += len(ref.scores) - len(np.unique(ref.scores))
        keys = table_keys(logp, ids)                                       # [D, K]
        selected += builders(D, candidates=True).candidates.entries(B) > 0
        # the candidate table's top-B wherever the budget fits it (depth <= 8), the pops, the planned: one tree
        for b, S in ((builders(D, candidates=True), 1), (builders(D, candidates=True), 3),
                     (builders(D, candidates=False), 1), (builders(D), 1)):
            # S = 3: rank r -> list r % 3, as tensor-parallel ranks deliver them
            lists = np.zeros((D, S, K), np.uint64)
            for s in range(S):
                part = keys[:, s::S]
                lists[:, s, : part.shape[1]] = part
            out = b.build(gpu.upload(lists), S, K, scalar(gpu, root), scalar(gpu, start), B).numpy()
            what = f"case {i}: D {D} K {K} B {B} {kind} S {S} candidates {b.candidates.entries(B)}"
            assert_tree_equal(out, ref, start, B, what)
            np.testing.assert_array_equal(out["table_ids"], ids, err_msg=what)
            np.testing.assert_array_equal(out["table_logp"].view(np.uint32), logp.view(np.uint32), err_msg=what)
    assert ties_seen > 100, "the cases must contain exactly tied path scores"
    assert 40 <= selected <= 120, f"{selected} of 150 cases built from the candidate table: both paths must run"


@pytest.mark.parametrize("D,V,B,ties", [(7, V_BIG, 64, False), (7, V_BIG, 255, True), (1, 16385, 16, True),
                                        (3, 1000, 255, False), (16, 40000, 1, True), (7, 100, 64, False)])
def test_topk_from_logits_matches_numpy(gpu, builders, D, V, B, ties):
    rng = np.random.default_rng(D * 1000 + B)
    x = tc.draft_logits(rng, D, V, ties)
    ref_logp, ref_ids = topk_logprobs(x, B)
    b = builders(D, V)
    root, start = 5, 1234
    out = b.run(gpu.upload(x), scalar(gpu, root), scalar(gpu, start), B).numpy()
    np.testing.assert_array_equal(out["table_ids"], ref_ids)
    np.testing.assert_allclose(out["table_logp"], ref_logp, rtol=0, atol=2e-5)
    # the tree is the numpy builder's on the device's own table, bit for bit
    assert_tree_equal(out, build_tree(root, out["table_logp"], out["table_ids"], B), start, B, f"D {D} V {V} B {B}")
    b.check_status()


SAMPLE_CASES = [
    # (V, n, shape, temperature, top_k, top_p, seed)
    (V_BIG, 65, "ties", 0.0, 0, 1.0, 0),
    (1000, 3, "flat", 0.0, 0, 1.0, 0),
    (V_BIG, 17, "peaked", 1.0, 0, 1.0, 3),
    (20000, 65, "flat", 0.7, 0, 1.0, (5 << 32) + 9),
    (333, 5, "flat", 2.5, 0, 1.0, 1),
    (V_BIG, 9, "peaked", 1.0, 1, 1.0, 2),
    (V_BIG, 9, "ties", 1.0, 5, 1.0, 2),
    (V_BIG, 9, "peaked", 0.8, 50, 1.0, 4),
    (70000, 9, "flat", 1.3, 256, 1.0, 4),
    (50000, 9, "ties", 1.0, 20, 0.8, 6),
    (V_BIG, 33, "peaked", 1.0, 0, 0.9, 7),          # certified from the candidates
    (V_BIG, 5, "ties", 1.0, 0, 0.95, (1 << 63) + 1),
    (50000, 5, "flat", 1.0, 0, 0.9, 8),             # tens of thousands kept: full-row path
    (20000, 5, "flat", 0.6, 0, 0.5, 9),
    (20000, 5, "flat", 1.0, 0, 1e-9, 10),           # keeps one token
    (V_BIG, 5, "peaked", 1.0, 0, 0.999999, 11),
    (300, 7, "ties", 1.0, 0, 0.9, 12),
    (16390, 7, "peaked", 1.0, 100, 0.3, 13),
]


@pytest.mark.parametrize("V,n,shape,temperature,top_k,top_p,seed", SAMPLE_CASES)
def test_sampler_matches_the_sampling_definition(gpu, V, n, shape, temperature, top_k, top_p, seed):
    from ddtree.plugins.tree_sample import TreeSampler
    rng = np.random.default_rng(V + n + seed % 1000)
    x = tc.target_logits(rng, n, V, shape)
    query_pos = rng.integers(0, (1 << 31) - 2, size=n).astype(np.int32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    ref = sample(x, query_pos.astype(np.int64) + 1, params)
    sampler = TreeSampler(gpu, vocab=V)
    out = sampler.run(gpu.upload(x), gpu.upload(query_pos), params, n)
    np.testing.assert_array_equal(out.target.numpy(), ref)
    sampler.check_status()
    full_rows = int(sampler.full_row_rows.numpy()[0])       # both top-p paths must be exercised
    if top_k or top_p >= 1 or top_p < 1e-3:
        assert full_rows == 0, "decided by the candidates"
    elif shape == "flat" and V > 256 * 8:
        assert full_rows == n, "top-p over a flat row needs the full-row path"
    elif V == V_BIG and top_p == 0.9:
        assert full_rows < n, "some peaked rows must be decided by the candidates"


def steer(tree: Tree, rng, p: float) -> np.ndarray:
    """[n] token to favour in each node's target logits: its child with the deepest subtree (with
    probability p), else -1."""
    height = np.zeros(tree.size, np.int64)
    for i in range(tree.size - 1, 0, -1):           # children come after their parents
        height[tree.parents[i]] = max(height[tree.parents[i]], height[i] + 1)
    favour = np.full(tree.size, -1, np.int64)
    for node, kids in enumerate(tree.children()):
        if kids and rng.random() < p:
            favour[node] = max(kids, key=lambda tok: (height[kids[tok]], -kids[tok]))
    return favour


WALK_PARAMS = [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, seed=3),
               SamplingParams(temperature=0.8, top_k=50, seed=4), SamplingParams(temperature=1.0, seed=5)]


@pytest.mark.parametrize("B", [1, 8, 64, 255])
def test_walk_matches_accept_walk(gpu, builders, B):
    from ddtree.plugins.tree_sample import TreeSampler
    D, V = 7, 4096
    rng = np.random.default_rng(B)
    b, sampler = builders(D, V), TreeSampler(gpu, vocab=V)
    deepest_tree, deepest_walk = 0, 0
    for trial in range(6):
        root, start = int(rng.integers(0, V)), int(rng.integers(0, 1 << 20))
        tree = b.run(gpu.upload(tc.draft_logits(rng, D, V, ties=trial % 2 == 1)),
                     scalar(gpu, root), scalar(gpu, start), B)
        t = tree.numpy()
        ref_tree = Tree(t["tokens"], t["parents"], t["depth"], [()] * (B + 1), t["scores"])
        always = trial < 3                      # favour the deepest child everywhere: greedy reaches the bottom
        favour = steer(ref_tree, rng, 1.0 if always else 0.7)
        x = tc.target_logits(rng, B + 1, V, "peaked", favour)
        for params in WALK_PARAMS:
            out = sampler.run(gpu.upload(x), tree.positions, params, B + 1, tree=tree)
            y = sample(x, t["positions"].astype(np.int64) + 1, params)
            walk = accept_walk(ref_tree, y)
            what = f"B {B} trial {trial} {params}"
            np.testing.assert_array_equal(out.target.numpy(), y, err_msg=what)
            count = int(out.count.numpy()[0])
            accepted = out.accepted.numpy()
            assert count == len(walk.accepted), what
            np.testing.assert_array_equal(accepted[:count], walk.accepted, err_msg=what)
            assert (accepted[count:] == -1).all(), what
            assert int(out.bonus.numpy()[0]) == walk.bonus, what
            if always and params.greedy:
                deepest_walk = max(deepest_walk, count - 1)
                deepest_tree = max(deepest_tree, int(t["depth"].max()))
    assert deepest_walk == deepest_tree, "greedy walks steered to the deepest child reach the tree's depth"
    sampler.check_status()


def test_captured_step_replays_with_new_device_inputs(gpu):
    """Build + sample + walk captured once; root, start and logits change between replays."""
    from ddtree.plugins.tree_build import DraftTreeBuilder
    from ddtree.plugins.tree_sample import TreeSampler
    D, V, B = 7, 30000, 32
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=21)
    b, sampler = DraftTreeBuilder(gpu, vocab=V, depth=D), TreeSampler(gpu, vocab=V)
    draft, target = gpu.alloc((D, V), np.float32), gpu.alloc((B + 1, V), np.float32)
    root, start = scalar(gpu, 0), scalar(gpu, 0)
    holder = {}

    def step(stream):
        holder["tree"] = b.run(draft, root, start, B, stream=stream)
        holder["out"] = sampler.run(target, holder["tree"].positions, params, B + 1, tree=holder["tree"],
                                    stream=stream)
    graph = gpu.capture(step)
    rng = np.random.default_rng(99)
    for replay in range(3):
        x_d = tc.draft_logits(rng, D, V, ties=True)
        r, s = int(rng.integers(0, V)), int(rng.integers(0, 1 << 24))
        gpu.copy_in(draft, x_d)
        gpu.copy_in(root, np.array([r], np.int32))
        gpu.copy_in(start, np.array([s], np.int32))
        ref_logp, ref_ids = topk_logprobs(x_d, B)
        ref_tree = build_tree(r, ref_logp, ref_ids, B)
        x_t = tc.target_logits(rng, B + 1, V, "peaked", favour=[
            next(iter(k)) if k else -1 for k in ref_tree.children()])
        gpu.copy_in(target, x_t)
        gpu.replay(graph)
        t = holder["tree"].numpy()
        np.testing.assert_array_equal(t["table_ids"], ref_ids)
        got_tree = Tree(t["tokens"], t["parents"], t["depth"], [()] * (B + 1), t["scores"])
        assert_tree_equal(t, build_tree(r, t["table_logp"], t["table_ids"], B), s, B, f"replay {replay}")
        y = sample(x_t, s + t["depth"].astype(np.int64) + 1, params)
        walk = accept_walk(got_tree, y)
        out = holder["out"]
        assert int(out.count.numpy()[0]) == len(walk.accepted), f"replay {replay}"
        assert int(out.bonus.numpy()[0]) == walk.bonus, f"replay {replay}"


def test_nan_logits_are_reported(gpu, builders):
    from ddtree.plugins.tree_sample import TreeSampler
    x = np.zeros((7, 5000), np.float32)
    x[3, 17] = np.nan
    for candidates in (True, False):                   # NaN scores: no consistent order, still no stray index
        b = builders(7, 5000, candidates)
        for B in (8, 64):
            out = b.run(gpu.upload(x), scalar(gpu, 0), scalar(gpu, 0), B).numpy()
            n = int(out["count"][0])
            assert 1 <= n <= B + 1 and (out["parents"][1:n] < np.arange(1, n)).all(), (candidates, B)
            with pytest.raises(ValueError, match="drafter logits contained NaN"):
                b.check_status()
    sampler = TreeSampler(gpu, vocab=5000)
    sampler.run(gpu.upload(x), gpu.upload(np.zeros(7, np.int32)), SamplingParams(), 7)
    with pytest.raises(ValueError, match="target logits contained NaN"):
        sampler.check_status()
