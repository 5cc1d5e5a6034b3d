"""An engine directory, loaded with its ranks simulated on CPU, computes what the float64 reference
computes on the source checkpoint: prefill, a tree-verify step, compaction, the drafter, and whole
DDTree generations (greedy and sampled) through DDTreeEngine and `ddtree run --model ENGINE`."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from ddtree.cli import main
from ddtree.reference.drafter import Drafter
from ddtree.reference.model import Target, causal_visible
from ddtree.runtime.engine import DDTreeEngine
from ddtree.runtime.engine_executor import EngineExecutor

ENGINES = [(1, "tp"), (2, "tp"), (4, "tp"), (2, "ep")]
RTOL = 1e-10
PROMPT = np.array([256] + list(b"def fib(n): return"))
TREE_TOKENS = np.array([33, 10, 65, 66, 67, 68, 69, 70, 259])
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 6]


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.abs(want).max())


def tree_visible(T, parents):
    """[q, T + q]: the whole cache plus each node's ancestors and itself."""
    q = len(parents)
    vis = np.zeros((q, T + q), dtype=bool)
    vis[:, :T] = True
    for i in range(q):
        j = i
        while j >= 0:
            vis[i, T + j] = True
            j = parents[j]
    return vis


def tree_depth(parents):
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return np.array(depth)


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    target = Target.from_checkpoint(tiny_ckpt[0])
    return target, Drafter.from_checkpoint(tiny_ckpt[1], target)


@pytest.fixture(scope="module")
def executors(engine_dir):
    return {key: EngineExecutor(engine_dir(*key)) for key in ENGINES}


@pytest.mark.parametrize("key", ENGINES, ids=[f"tp{t}-{m}" for t, m in ENGINES])
def test_prefill_tree_verify_and_compact_match_reference(reference, executors, key):
    target, _ = reference
    ex = executors[key]
    taps = (1, 2)
    ref_cache, eng_cache = target.new_cache(), ex.new_target_cache()
    P = len(PROMPT)
    want, want_taps = target.forward(PROMPT, np.arange(P), causal_visible(0, P), ref_cache, taps)
    got, got_taps = ex.target_forward(PROMPT, np.arange(P), causal_visible(0, P), eng_cache, taps)
    assert got.shape == want.shape == (P, target.config.vocab_size)
    close(got, want)
    for L in taps:
        close(got_taps[L], want_taps[L])
    # a DDTree verify step: tree nodes at positions P + depth, tree visibility over the cache
    pos = P + tree_depth(TREE_PARENTS)
    vis = tree_visible(P, TREE_PARENTS)
    want, _ = target.forward(TREE_TOKENS, pos, vis, ref_cache)
    got, _ = ex.target_forward(TREE_TOKENS, pos, vis, eng_cache)
    close(got, want)
    # keep the path 0 -> 1 -> 3 -> 6? (6's parent is 2): keep root, 1, 3, then decode one more token
    keep = [0, 1, 3]
    ref_cache.compact(P, keep)
    ex.compact(eng_cache, P, keep)
    for r in range(ex.tp):                                # the replicated latent cache is equal on every rank
        for L in range(target.config.num_hidden_layers):
            close(eng_cache.entries(L, rank=r), ref_cache.entries(L))
    T = ref_cache.length
    want, _ = target.forward([77], [T], np.ones((1, T + 1), bool), ref_cache)
    got, _ = ex.target_forward([77], [T], np.ones((1, T + 1), bool), eng_cache)
    close(got, want)


@pytest.mark.parametrize("key", ENGINES, ids=[f"tp{t}-{m}" for t, m in ENGINES])
def test_drafter_matches_reference(reference, executors, key):
    target, drafter = reference
    ex = executors[key]
    rng = np.random.default_rng(3)
    H, K = target.config.hidden_size, len(drafter.config.target_layer_ids)
    ref_cache, eng_cache = drafter.new_cache(), ex.new_drafter_cache()
    start = 0
    for n, b in ((5, 0), (2, 1), (0, 0), (3, 2)):              # context tokens committed before each block, and
        ctx = rng.standard_normal((n, K * H))                 # how much shorter than the drafter's the block is
        start += n
        block = np.array([int(rng.integers(0, 256))] + [drafter.config.mask_token_id] * (drafter.config.block_size - 1 - b))
        pos = np.arange(start, start + len(block))
        want = drafter.forward(block, pos, ctx, ref_cache)
        got = ex.drafter_forward(block, pos, ctx, eng_cache)
        close(got, want)
        assert eng_cache.length == ref_cache.length == start


@pytest.mark.parametrize("key", ENGINES, ids=[f"tp{t}-{m}" for t, m in ENGINES])
def test_ddtree_on_engine_equals_ddtree_on_checkpoint(tiny_ckpt, engine_dir, key):
    on_ckpt = DDTreeEngine.load(*tiny_ckpt)
    on_engine = DDTreeEngine.load(engine_dir(*key))
    assert on_engine.executor.tp == key[0]
    for params in (dict(), dict(temperature=0.8, top_k=40, top_p=0.9, seed=7), dict(temperature=1.0, seed=2**33)):
        want = on_ckpt.generate("def fib(n):", max_new_tokens=24, budget=8, **params)
        got = on_engine.generate("def fib(n):", max_new_tokens=24, budget=8, **params)
        assert got.tokens == want.tokens and len(got.tokens) == 24
    ar = on_engine.generate("def fib(n):", max_new_tokens=24, mode="ar")
    assert ar.tokens == on_ckpt.generate("def fib(n):", max_new_tokens=24, budget=8).tokens


def test_run_cli_with_engine_dir(tiny_ckpt, engine_dir):
    engine = str(engine_dir(2))
    r = CliRunner().invoke(main, ["run", "--model", engine, "hello", "--mode", "both", "--json",
                                  "--max-new-tokens", "16", "--budget", "4"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    want = DDTreeEngine.load(*tiny_ckpt).generate("hello", max_new_tokens=16, budget=4)
    assert out["identical"] is True and out["tokens"] == want.tokens
    r = CliRunner().invoke(main, ["run", "--model", engine, "--drafter", str(tiny_ckpt[1]), "x"])
    assert r.exit_code != 0 and "drafter built in" in r.output


def test_grouped_routing_and_flat_layout(tmp_path):
    """n_group > 1 routing and the K2-Thinking (flat, `model.`) layout, expert-parallel at tp 4."""
    from ddtree.builder.build import build_engine
    from ddtree.model.synthetic import synth
    target_dir, drafter_dir = synth(tmp_path / "ckpt", "tiny-grouped", seed=4, layout="k2-thinking", shard_mb=2)
    engine = build_engine(target_dir, drafter_dir, 4, ["sm_120"], tmp_path / "engine", experts="ep")["engine"]
    target, ex = Target.from_checkpoint(target_dir), EngineExecutor(engine)
    assert target.config.n_group == 4 and ex.layouts[3].expert_start == 12
    P = len(PROMPT)
    want, _ = target.forward(PROMPT, np.arange(P), causal_visible(0, P), target.new_cache())
    got, _ = ex.target_forward(PROMPT, np.arange(P), causal_visible(0, P), ex.new_target_cache())
    close(got, want)
