"""description/stack.py ddtree_step_requests, the DDTree step of Rq requests over the op set (each request's drafter
and tree, ONE target forward over the union rows, each request's head, walk and compaction), on an engine dir's
numpy ranks (tp 1 and 2), against each request's own stack.ddtree_step on copies of its caches: the same accept
outputs exactly (greedy and sampled, different budgets, prompt lengths and seeds), the same caches to 1e-12 (the
union's row-wise products sum in BLAS's order for the union's row count: tests/runtime/test_union_verify.py)."""
import numpy as np
import pytest

from ddtree.backends.meter import meter_step
from ddtree.backends.meter_requests import meter_step_requests
from ddtree.builder.build import build_engine
from ddtree.builder.plan import make_plan
from ddtree.builder.weights import rank_tensor_specs
from ddtree.data import tiny_model_dirs
from ddtree.description import layers, stack
from ddtree.model.presets import get_preset
from ddtree.reference.model import causal_visible
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.runtime.per_rank import PerRank

# (prompt rows, budget, temperature, seed)
REQUESTS = [(6, 4, 0.0, 0), (21, 16, 0.8, 7), (11, 8, 1.0, 2**40 + 3)]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def executor(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"step{request.param}") / "engine"
    return EngineExecutor(build_engine(*tiny_model_dirs(), request.param, [], out, graphs=False,
                                       kernels=False)["engine"])


def seed_words(seed: int) -> np.ndarray:
    return np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32).view(np.int32)         # (low, high)


def request_feeds(ex, prompt: int, temperature: float, seed: int, rng) -> tuple:
    """A prefilled target cache, a fresh drafter cache and the StepFeeds of one request's step after `prompt`
    rows (the drafter's context: random taps of those rows; the bonus: a random token)."""
    cfg, d = ex.config, ex.drafter_config
    cache = ex.new_target_cache(64, 512)
    ex.target_forward(rng.integers(0, cfg.vocab_size, prompt), np.arange(prompt), causal_visible(0, prompt), cache)
    bonus, b = int(rng.integers(0, cfg.vocab_size)), d.block_size
    draft = {"ctx_taps": rng.standard_normal((prompt, d.num_taps * d.hidden_size)),
             "ids": np.array([bonus] + [d.mask_token_id] * (b - 1), np.int32),
             "pos": np.arange(prompt, prompt + b, dtype=np.int32), "cache_len": np.zeros(1, np.int32)}
    T = np.array([prompt], np.int32)
    feeds = stack.StepFeeds(
        draft, np.array([bonus], np.int32),
        verify=lambda tree: {"ids": tree["tokens"][0], "pos": (prompt + tree["depth"][0]).astype(np.int32),
                             "cache_len": T, "tree_mask": tree["visibility"][0]},
        head=lambda v: {"sample_pos": v["pos"] + 1, "temperature": np.array([temperature], np.float32),
                        "seed": seed_words(seed)},
        compact=lambda walk: {"cache_len": T, "accepted": walk["accepted"][0],
                              "accepted_count": walk["accepted_count"][0]})
    return cache, feeds


def union_feeds(requests: list) -> stack.RequestStepFeeds:
    spans = []

    def union(verifies: list) -> dict:
        rows = [len(v["ids"]) for v in verifies]
        off = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
        spans[:] = list(zip(off[:-1], off[1:]))
        joined = {k: np.concatenate([v[k] for v in verifies]) for k in ("ids", "pos", "cache_len")}
        return {**joined, "row_offsets": off, **{f"tree_mask.{i}": v["tree_mask"] for i, v in enumerate(verifies)}}

    return stack.RequestStepFeeds(requests, union, lambda h, i: PerRank(x[spans[i][0]: spans[i][1]] for x in h))


def test_the_union_step_is_each_requests_own_step(executor):
    ex, rng = executor, np.random.default_rng(4)
    lay = ex.layouts[0]
    k = layers.draft_topk([16], lay.vocab_stop - lay.vocab_start)
    made = [request_feeds(ex, P, t, s, rng) for P, _, t, s in REQUESTS]
    budgets = [B for _, B, _, _ in REQUESTS]
    own = [cache.copy() for cache, _ in made]
    alone = [stack.ddtree_step(ex.run, ex.config, ex.drafter_config, ex.moe_inter, k, B, feeds, cache,
                               ex.new_drafter_cache())
             for (_, feeds), cache, B in zip(made, own, budgets)]
    walks = stack.ddtree_step_requests(ex.run, ex.config, ex.drafter_config, ex.moe_inter, k, budgets,
                                       union_feeds([f for _, f in made]), [c for c, _ in made],
                                       [ex.new_drafter_cache() for _ in made])
    for walk, want, (cache, _), mine, (P, B, _, _) in zip(walks, alone, made, own, REQUESTS):
        for name in ("target_tokens", "accepted", "accepted_count", "bonus"):
            for r in range(ex.held):
                assert (walk[name][r] == want[name][r]).all(), name
        assert len(walk["target_tokens"][0]) == B + 1
        n = int(walk["accepted_count"][0][0])
        for L in range(ex.config.num_hidden_layers):
            got, exp = cache.entries(L, P + n), mine.entries(L, P + n)
            assert np.allclose(got, exp, rtol=0, atol=1e-12 * np.abs(exp).max())
    assert len(set(tuple(w["target_tokens"][0][:3]) for w in walks)) == 3       # three different requests


@pytest.fixture(scope="module")
def kimi_tp8():
    cfg, dcfg = get_preset("kimi-k2.6", layers=3)
    plan = make_plan(cfg, dcfg, 8)
    return cfg, dcfg, plan.to_dict(), rank_tensor_specs(plan)


def test_the_metered_union_step_reads_the_weights_once_and_each_cache_prefix(kimi_tp8):
    """Kimi rank 0, two requests (4096 cached, budget 8; 1024, budget 16): the decoder layers' weights once per
    step, not per request; each request's attention reads its own prefix; the drafter, the tree, the head and the
    walk are per request (so the drafter's and lm_head's weights are read twice)."""
    cfg, dcfg, plan, specs = kimi_tp8
    reqs = [(4096, 8), (1024, 16)]
    union = meter_step_requests(cfg, dcfg, plan, specs, requests=reqs)
    singles = [meter_step(cfg, dcfg, plan, specs, context=T, budget=B) for T, B in reqs]

    def weights(recs, kinds):
        return sum(r.weight_read for r in recs if r.kind in kinds and r.op != "moe.experts")

    target = ("dense_layer", "moe_layer")
    assert weights(union, target) == weights(singles[0], target) == weights(singles[1], target)
    for kind in ("draft_layer", "draft_head", "head"):
        assert weights(union, (kind,)) == weights(singles[0], (kind,)) + weights(singles[1], (kind,)) > 0
    attn = [r for r in union if r.op == "mla_tree_attention_requests"]
    one = [[r for r in s if r.op == "mla_tree_attention"] for s in singles]
    assert len(attn) == 2 * cfg.num_hidden_layers
    for i in range(2):
        mine = [r for r in attn if r.detail["request"] == i]
        assert [(r.read, r.written, r.flops) for r in mine] == [(r.read, r.written, r.flops) for r in one[i]]
