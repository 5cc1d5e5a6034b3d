"""GPU tests of the vocab-parallel node kernels (plugins/vocab_nodes.py) against backends/numpy_math.py at tp 1..8:
each rank's slice of one vocab (its vocab_start), the winners / candidates gathered in rank order, then merged.

VocabWinner: ids equal to numpy's per rank, and the gathered winners' merge equal to the sampling definition on
the whole vocab (tree/sampling.sample), greedy (values exact; exact ties across ranks) and Gumbel at T 0.7 / 1.3
(values within one float32 ulp) over several seeds (above 2^32 too) and positions. VocabTopK: values, ids and
row_max exact, row_sumexp within 5e-6 of the sliced twin and of numpy (fp32 sums in another order). TreeBuild:
tokens, parents, depth and visibility equal to numpy's at budgets 1 / 4 / 16 / 64 whenever numpy's tree is
decisive (the same tree for normalisers shifted by up to ~1.5e-5 either way; docs/interfaces.md 6), from
numpy's and from the kernels' candidates. AcceptWalk: exact, with exact value ties across ranks. Vocabularies:
a drafter's 1000 ids and Kimi's 163840 (20480 per rank at tp 8). A CUDA graph of the whole tp 2 chain replays
3 times with its inputs rewritten in place (greedy, then sampled with new seeds) and equals numpy each time;
the cuda backend runs the same kernels at tp 1, 2 and 8 (ranks as threads, layers.tree / layers.accept
gathering through the ranks' collectives).
"""
from types import SimpleNamespace

import numpy as np
import pytest
import tree_cases as tc

from ddtree.backends import numpy_math as m
from ddtree.plugins.vocab_nodes import tree_capacity
from ddtree.tree.build import build_tree
from ddtree.tree.sampling import SamplingParams, sample

pytestmark = pytest.mark.gpu
# (V_r, tp): a drafter vocab of ~1000 ids split over tp ranks, and Kimi's 163840
SPLITS = [(1000, 1), (500, 2), (334, 3), (250, 4), (125, 8), (163840, 1), (81920, 2), (20480, 8)]
BUDGETS = (1, 4, 16, 64)
SHIFTS = (1 - 2 ** -16, 1 - 2 ** -18, 1.0, 1 + 2 ** -18, 1 + 2 ** -16)   # normaliser perturbations (near-ties)


def seed_words(seed: int) -> np.ndarray:
    return np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32).view(np.int32)


def f32(v) -> float:
    return float(np.float32(v))


def rank_slices(x: np.ndarray, V_r: int, tp: int) -> list[np.ndarray]:
    return [np.ascontiguousarray(x[:, r * V_r: (r + 1) * V_r]) for r in range(tp)]


def within_ulp(got: np.ndarray, want: np.ndarray) -> bool:
    want = np.asarray(want, np.float32)
    return bool((np.abs(got - want) <= np.spacing(np.abs(want))).all())


def numpy_candidates(parts: list[np.ndarray], k: int, V_r: int) -> tuple:
    """The ranks' numpy vocab_topk, gathered: values / ids [tp, D, k], row_max / row_sumexp [tp, D]."""
    outs = [m.vocab_topk(x, k, r * V_r) for r, x in enumerate(parts)]
    return tuple(np.stack([o[i] for o in outs]) for i in range(4))


def decisive_tree(root: int, cands: tuple, budget: int):
    """numpy's tree tensors, or None when a normaliser shifted by up to ~1.5e-5 builds another tree (a near-tie:
    the kernels' expf / logf may differ from numpy's in the last bits)."""
    values, ids, row_max, row_sumexp = cands
    trees = [m.tree_tensors(m.tree_build(root, values, ids, row_max, (row_sumexp * np.float32(s)).astype(np.float32),
                                         budget)) for s in SHIFTS]
    same = all(all(np.array_equal(a, b) for a, b in zip(t, trees[2])) for t in trees)
    return trees[2] if same else None


def assert_tree(got: list[np.ndarray], want: tuple, what: str) -> None:
    for name, g, w in zip(("tokens", "parents", "depth", "visibility"), got, want):
        np.testing.assert_array_equal(g, np.asarray(w, np.int32).reshape(g.shape), err_msg=f"{what}: {name}")


@pytest.fixture(scope="module")
def launchers(gpu):
    from ddtree.plugins import vocab_nodes as vn
    cache = {}

    def get(cls, *args, **kw):
        key = (cls, args, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = getattr(vn, cls)(gpu, *args, **kw)
        return cache[key]
    return get


@pytest.mark.parametrize("V_r, tp", SPLITS)
def test_vocab_winner_per_rank_and_gathered(gpu, launchers, V_r, tp):
    rng = np.random.default_rng(V_r * 10 + tp)
    n = 64 if V_r * tp <= 2000 else 4
    x = tc.target_logits(rng, n, V_r * tp, "ties")                  # exact ties among each row's top values
    x[0, [3, V_r * tp - 1]] = x[0].max() + 1                         # a tie across the first and last rank
    pos = rng.integers(0, 1 << 30, n).astype(np.int32)
    parts = rank_slices(x, V_r, tp)
    d_parts, d_pos = [gpu.upload(p) for p in parts], gpu.upload(pos)
    temp, seed = gpu.alloc((1,), np.float32), gpu.alloc((2,), np.int32)
    value, ids = gpu.alloc((tp, n), np.float32), gpu.alloc((tp, n), np.int32)
    for T, s in ((0.0, 0), (0.7, 1), (0.7, (1 << 40) + 7), (1.3, 12345)):
        gpu.copy_in(temp, np.array([T], np.float32))
        gpu.copy_in(seed, seed_words(s))
        for r in range(tp):
            launchers("VocabWinner", V_r, r * V_r).run(d_parts[r], d_pos, temp, seed, value.view(r * n, (n,)),
                                                       ids.view(r * n, (n,)), n)
        got_v, got_i = value.numpy(), ids.numpy()
        what = f"V_r {V_r} tp {tp} T {T} seed {s}"
        for r in range(tp):
            want_v, want_i = m.vocab_winner(parts[r], pos, f32(T), s, r * V_r)
            np.testing.assert_array_equal(got_i[r], want_i, err_msg=f"{what}: rank {r} ids")
            if T == 0:
                np.testing.assert_array_equal(got_v[r], want_v.astype(np.float32), err_msg=f"{what}: rank {r}")
            else:
                assert within_ulp(got_v[r], want_v), f"{what}: rank {r} values beyond one float32 ulp"
        target, *_ = m.accept_walk_winners(np.zeros(n, np.int32), np.full(n, -1, np.int32), got_v, got_i)
        want = sample(x, pos, SamplingParams(temperature=f32(T), seed=s))
        np.testing.assert_array_equal(target, want, err_msg=f"{what}: the gathered winners vs the definition")
        assert T > 0 or target[0] == 3, f"{what}: the lower id of a tie across ranks"


@pytest.mark.parametrize("V_r, tp", SPLITS)
def test_vocab_topk_per_rank(gpu, launchers, V_r, tp):
    from ddtree.plugins.vocab_nodes import sliced_sumexp
    rng = np.random.default_rng(V_r + tp)
    for D, budget in ((1, 4), (7, 64), (15, 16), (3, 1)):
        k = min(budget, V_r)
        parts = rank_slices(tc.draft_logits(rng, D, V_r * tp, ties=True), V_r, tp)
        for r, x in enumerate(parts):
            outs = [gpu.alloc((D, k), np.float32), gpu.alloc((D, k), np.int32), gpu.alloc((D,), np.float32),
                    gpu.alloc((D,), np.float32)]
            launchers("VocabTopK", V_r, k, r * V_r, max_rows=16).run(gpu.upload(x), *outs, D)
            values, ids, row_max, row_sumexp = (o.numpy() for o in outs)
            want = m.vocab_topk(x, k, r * V_r)
            what = f"V_r {V_r} rank {r} of {tp}, D {D} k {k}"
            np.testing.assert_array_equal(values, want[0], err_msg=what)
            np.testing.assert_array_equal(ids, want[1], err_msg=what)
            np.testing.assert_array_equal(row_max, want[2], err_msg=what)
            np.testing.assert_allclose(row_sumexp, sliced_sumexp(x)[1], rtol=5e-6, err_msg=what)
            np.testing.assert_allclose(row_sumexp, want[3], rtol=5e-6, err_msg=what)


@pytest.mark.parametrize("V_r, tp", SPLITS)
def test_tree_build_from_gathered_candidates(gpu, launchers, V_r, tp):
    rng = np.random.default_rng(3 * V_r + tp)
    decisive = 0
    for budget in BUDGETS:
        for D in (7, 15) if budget == 64 else (7,):
            k, n = min(budget, V_r), budget + 1
            parts = rank_slices(tc.draft_logits(rng, D, V_r * tp, ties=True), V_r, tp)
            cands = numpy_candidates(parts, k, V_r)
            root = int(rng.integers(0, V_r * tp))
            want = decisive_tree(root, cands, budget)
            if want is None:
                continue
            decisive += 1
            build = launchers("TreeBuild", tp, D, k, budget)
            outs = [gpu.alloc((n,), np.int32) for _ in range(3)] + [gpu.alloc((n, -(-n // 32)), np.int32)]
            d_root = gpu.upload(np.array([root], np.int32))
            build.run(d_root, *(gpu.upload(c) for c in cands), *outs)
            assert_tree([o.numpy() for o in outs], want, f"V_r {V_r} tp {tp} B {budget} D {D}: numpy's candidates")
            # the whole chain on the device: each rank's top-k written into its slot of the gathered buffers
            gathered = [gpu.alloc((tp, D, k), np.float32), gpu.alloc((tp, D, k), np.int32),
                        gpu.alloc((tp, D), np.float32), gpu.alloc((tp, D), np.float32)]
            for r, x in enumerate(parts):
                slots = [g.view(r * int(np.prod(g.shape[1:])), g.shape[1:]) for g in gathered]
                launchers("VocabTopK", V_r, k, r * V_r, max_rows=16).run(gpu.upload(x), *slots, D)
            build.run(d_root, *gathered, *outs)
            assert_tree([o.numpy() for o in outs], want, f"V_r {V_r} tp {tp} B {budget} D {D}: the kernels' top-k")
    assert decisive >= 4, f"only {decisive} of 5 cases were decisive"


@pytest.mark.parametrize("tp", [1, 2, 3, 5, 8])
def test_accept_walk_merges_the_winners_and_walks(gpu, launchers, tp):
    rng = np.random.default_rng(tp)
    V_r = 125
    for budget in BUDGETS * 3:
        D, K = int(rng.integers(1, 9)), int(rng.integers(1, 6))
        logp, cand = tc.table(rng, D, K, V_r * tp, "smooth")
        tree = build_tree(int(rng.integers(0, V_r * tp)), logp, cand, min(budget, tree_capacity(D, K)))
        n, kids = tree.size, tree.children()
        win_id = np.arange(tp)[:, None] * V_r + rng.integers(0, V_r, size=(tp, n))     # each rank's own ids
        win_value = rng.integers(0, 3, size=(tp, n)).astype(np.float32)      # exact ties across ranks
        for i in range(n):                                                  # steer the walk down the tree
            if kids[i] and rng.random() < 0.85:
                t = int(rng.choice(list(kids[i])))
                win_id[t // V_r, i], win_value[t // V_r, i] = t, 3.0
        win_id = win_id.astype(np.int32)
        want = m.accept_walk_winners(tree.tokens, tree.parents, win_value, win_id)
        ins = [gpu.upload(a) for a in (tree.tokens.astype(np.int32), tree.parents.astype(np.int32), win_value, win_id)]
        outs = [gpu.alloc((n,), np.int32), gpu.alloc((n,), np.int32), gpu.alloc((1,), np.int32),
                gpu.alloc((1,), np.int32)]
        launchers("AcceptWalk", tp).run(*ins, *outs, n)
        for name, g, w in zip(("target", "accepted", "count", "bonus"), (o.numpy() for o in outs), want):
            np.testing.assert_array_equal(g, w, err_msg=f"tp {tp} budget {budget} n {n}: {name}")


def step_inputs(rng, V_r: int, tp: int, D: int, k: int, budget: int):
    """A decisive draft (numpy's tree stable under the normaliser shifts) and target logits steered down it."""
    while True:
        draft = tc.draft_logits(rng, D, V_r * tp, ties=True)
        root = int(rng.integers(0, V_r * tp))
        want = decisive_tree(root, numpy_candidates(rank_slices(draft, V_r, tp), k, V_r), budget)
        if want is not None:
            break
    tokens, parents = want[0], want[1]
    favour = np.full(budget + 1, -1)
    for i in range(budget + 1):
        kids = np.flatnonzero(parents == i)
        if len(kids):
            favour[i] = tokens[rng.choice(kids)]
    target = tc.target_logits(rng, budget + 1, V_r * tp, "peaked", favour=favour)
    return draft, root, target, want


def test_a_graph_of_the_tp2_chain_replays_with_new_inputs(gpu, launchers):
    V_r, tp, D, budget = 20480, 2, 7, 16
    k, n, rng = min(budget, V_r), budget + 1, np.random.default_rng(5)
    draft = [gpu.alloc((D, V_r), np.float32) for _ in range(tp)]
    target = [gpu.alloc((n, V_r), np.float32) for _ in range(tp)]
    root, pos, temp, seed = (gpu.alloc((1,), np.int32), gpu.alloc((n,), np.int32), gpu.alloc((1,), np.float32),
                             gpu.alloc((2,), np.int32))
    gathered = [gpu.alloc((tp, D, k), np.float32), gpu.alloc((tp, D, k), np.int32), gpu.alloc((tp, D), np.float32),
                gpu.alloc((tp, D), np.float32)]
    tree = [gpu.alloc((n,), np.int32) for _ in range(3)] + [gpu.alloc((n, 1), np.int32)]
    wins = [gpu.alloc((tp, n), np.float32), gpu.alloc((tp, n), np.int32)]
    walk = [gpu.alloc((n,), np.int32), gpu.alloc((n,), np.int32), gpu.alloc((1,), np.int32), gpu.alloc((1,), np.int32)]
    build, walker = launchers("TreeBuild", tp, D, k, budget), launchers("AcceptWalk", tp)

    def step(s):
        for r in range(tp):
            slots = [g.view(r * int(np.prod(g.shape[1:])), g.shape[1:]) for g in gathered]
            launchers("VocabTopK", V_r, k, r * V_r, max_rows=16).run(draft[r], *slots, D, stream=s)
        build.run(root, *gathered, *tree, stream=s)
        for r in range(tp):
            launchers("VocabWinner", V_r, r * V_r).run(target[r], pos, temp, seed, wins[0].view(r * n, (n,)),
                                                       wins[1].view(r * n, (n,)), n, stream=s)
        walker.run(tree[0], tree[1], *wins, *walk, n, stream=s)

    for a in (root, pos, temp, seed):                     # a first eager step on defined inputs, then capture
        gpu.copy_in(a, np.zeros(a.shape, a.dtype))
    for a in draft + target:
        gpu.copy_in(a, np.zeros(a.shape, np.float32))
    step(None)
    graph = gpu.capture(step)
    counts = []
    for i, (T, s) in enumerate(((0.0, 11), (0.7, 12), (0.7, (1 << 33) + 13))):
        d, r0, t, want_tree = step_inputs(rng, V_r, tp, D, k, budget)
        p = rng.integers(0, 1 << 20, n).astype(np.int32)
        for r in range(tp):
            gpu.copy_in(draft[r], rank_slices(d, V_r, tp)[r])
            gpu.copy_in(target[r], rank_slices(t, V_r, tp)[r])
        for a, v in ((root, np.array([r0], np.int32)), (pos, p), (temp, np.array([T], np.float32)),
                     (seed, seed_words(s))):
            gpu.copy_in(a, v)
        gpu.replay(graph)
        assert_tree([o.numpy() for o in tree], want_tree, f"replay {i}")
        win = [m.vocab_winner(x, p, f32(T), s, r * V_r) for r, x in enumerate(rank_slices(t, V_r, tp))]
        want = m.accept_walk_winners(want_tree[0], want_tree[1], np.stack([w[0] for w in win]).astype(np.float32),
                                     np.stack([w[1] for w in win]))
        np.testing.assert_array_equal(wins[1].numpy(), np.stack([w[1] for w in win]), err_msg=f"replay {i}: winners")
        for name, g, w in zip(("target", "accepted", "count", "bonus"), (o.numpy() for o in walk), want):
            np.testing.assert_array_equal(g, w, err_msg=f"replay {i} (T {T}): {name}")
        counts.append(int(walk[2].numpy()[0]))
    assert max(counts) >= 2, f"the steered walks accepted {counts} nodes: none past the root"


@pytest.fixture(scope="module")
def rank_gpus():
    from ddtree.plugins.device import Gpu
    gpus = [Gpu(0) for _ in range(8)]
    yield gpus
    for g in gpus:
        g.free_all()


def heads(ops, V_r: int, k: int) -> None:
    """Each rank's part before the gathers: the draft top-k and the target winners (layers.draft_head's and
    layers.head's node calls, on fed logits)."""
    from ddtree.description.opset import ACC, F32, I32
    values, ids, row_max, row_sumexp = ops.vocab_topk(ops.input("draft", ["D", V_r], F32), k)
    value, winner = ops.vocab_winner(ops.input("target", ["n", V_r], ACC), ops.input("sample_pos", ["n"], I32),
                                     ops.input("temperature", [1], F32), ops.input("seed", [2], I32))
    for name, x, dtype in (("topk_values", values, F32), ("topk_ids", ids, I32), ("row_max", row_max, F32),
                           ("row_sumexp", row_sumexp, F32), ("win_value", value, ACC), ("win_id", winner, I32)):
        ops.output(name, x, list(x.shape), dtype)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_the_cuda_backend_runs_the_node_kernels_at_any_tp(rank_gpus, tp):
    """layers.tree and layers.accept through CudaOps, the ranks as threads gathering through their collectives:
    every rank holds numpy's tree, targets and walk."""
    from ddtree.backends.cuda_backend import CudaOps
    from ddtree.description import layers
    from ddtree.description.opset import RankLayout
    from ddtree.parallel.cuda_collectives import ThreadRankGroup, run_ranks
    from ddtree.plugins.device import DeviceArray
    V_r, D, budget, T, s = 20480 if tp == 8 else 1000, 7, 64, 0.7, 99
    k, n, rng = min(budget, V_r), budget + 1, np.random.default_rng(tp)
    draft, root, target, want_tree = step_inputs(rng, V_r, tp, D, k, budget)
    pos = rng.integers(0, 1 << 20, n).astype(np.int32)
    group = ThreadRankGroup(tp) if tp > 1 else None
    dcfg = SimpleNamespace(block_size=D + 1)

    def rank(r):
        try:
            return rank_step(r)
        except BaseException:
            if group:
                group.abort()                            # release the other ranks' barriers
            raise

    def rank_step(r):
        lay = RankLayout(r, tp, r * V_r, (r + 1) * V_r, 0, 8, 0, 64)
        ops = CudaOps(rank_gpus[r], lay, store=None, collective=group.member(r) if group else None)
        mine = ops.call(heads, V_r, k, feeds={"draft": rank_slices(draft, V_r, tp)[r],
                                                "target": rank_slices(target, V_r, tp)[r], "sample_pos": pos,
                                                "temperature": np.array([T], np.float32), "seed": seed_words(s)})
        built = ops.call(layers.tree, dcfg, k, budget, feeds={"root": np.array([root], np.int32),
                                                              **{name: mine[name] for name in
                                                                 ("topk_values", "topk_ids", "row_max", "row_sumexp")}})
        walked = ops.call(layers.accept, feeds={"tokens": built["tokens"], "parents": built["parents"],
                                                "win_value": mine["win_value"], "win_id": mine["win_id"]})
        return {name: DeviceArray(ops.gpu, t.ptr, t.shape, t.dtype).numpy() for name, t in {**built, **walked}.items()}

    executors = [SimpleNamespace(gpu=g, rank=r, ops=SimpleNamespace(collective=None))
                 for r, g in enumerate(rank_gpus[:tp])]
    outs = run_ranks(executors, lambda ex: rank(ex.rank))
    win = [m.vocab_winner(x, pos, f32(T), s, r * V_r) for r, x in enumerate(rank_slices(target, V_r, tp))]
    want = m.accept_walk_winners(want_tree[0], want_tree[1], np.stack([w[0] for w in win]).astype(np.float32),
                                 np.stack([w[1] for w in win]))
    for r, out in enumerate(outs):
        built = [out[name] for name in ("tokens", "parents", "depth", "visibility")]
        assert_tree(built, want_tree, f"tp {tp} rank {r}")
        for name, w in zip(("target_tokens", "accepted", "accepted_count", "bonus"), want):
            np.testing.assert_array_equal(out[name], w, err_msg=f"tp {tp} rank {r}: {name}")
