"""`ddtree bench step --requests` on the CPU: its refusals (before any GPU is touched), the union verify's host
feeds against the trees, the union meter against a hand formula and the step-of-requests meter, the memory
plan's refusal, and the JSON rows from a fake timer."""
from types import SimpleNamespace

import click
import numpy as np
import pytest

from ddtree.backends.meter import totals
from ddtree.backends.meter_requests import meter_step_requests, meter_union_verify
from ddtree.bench.routing import distinct_per_layer
from ddtree.builder.plan import make_plan
from ddtree.builder.weights import rank_tensor_specs
from ddtree.model.presets import get_preset
from ddtree.tree.build import Tree, unpack_visibility
from tests.cli.bad_input import refuses


@pytest.fixture(scope="module")
def kimi():
    cfg, dcfg = get_preset("kimi-k2.6", 3)                       # layer 0 dense, 1 and 2 MoE
    plan = make_plan(cfg, dcfg, 8)
    return cfg, dcfg, plan, rank_tensor_specs(plan)


def test_requests_flag_refusals_name_the_flag():
    from ddtree.bench.project_requests import parse_requests
    assert parse_requests("4,1,2,2") == [1, 2, 4]
    refuses(["bench", "step", "--requests", "0,2"], "--requests", code=2)
    refuses(["bench", "step", "--requests", "two"], "--requests", code=2)
    refuses(["bench", "step", "--requests", "1,2", "--ar"], "--ar is not measured", code=2)
    refuses(["bench", "step", "--requests", "1,2", "--tp", "2", "--ranks", "all"], "--ranks all", code=2)
    refuses(["bench", "step", "--requests", "1,2", "--collectives", "copy,pcie"], "--collectives", code=2)
    refuses(["bench", "step", "--requests", "1,4", "--budget", "64"], "4 requests x (budget 64 + 1) = 260", code=2)
    refuses(["bench", "step", "--requests", "1", "--context", "262140", "--budget", "8"], "--context", "262149",
            code=2)


def test_union_feeds_are_each_trees_rows_masks_and_positions():
    from ddtree.bench.step_requests import stated_tree, union_feeds
    a, b = stated_tree(8, 8), stated_tree(4, 8)
    f = union_feeds([a.parents, b.parents], 100, 1000, seed=3)
    assert f["row_offsets"].tolist() == [0, a.size, a.size + b.size] and f["cache_len"].tolist() == [100, 100]
    depth = np.concatenate([Tree.from_parents(t.parents).depth for t in (a, b)])
    assert (f["pos"] == 100 + depth).all() and f["ids"].shape == (a.size + b.size,)
    for i, t in enumerate((a, b)):                 # each mask: ancestor-or-self within its own tree, by brute force
        vis = unpack_visibility(f[f"tree_mask.{i}"].view(np.uint32), t.size)
        for r in range(t.size):
            anc, j = {r}, r
            while t.parents[j] >= 0:
                j = int(t.parents[j])
                anc.add(j)
            assert set(np.flatnonzero(vis[r]).tolist()) == anc
    one = union_feeds([a.parents], 7, 1000)
    assert set(one) == {"ids", "pos", "cache_len", "tree_mask"} and one["cache_len"].tolist() == [7]


def test_the_union_meter_reads_each_requests_cache_and_the_weights_once(kimi):
    cfg, dcfg, plan, specs = kimi
    p = plan.to_dict()
    reqs = [(4096, 9), (1000, 17)]
    moe = len(cfg.moe_layers)
    union = meter_union_verify(cfg, p, specs, 0, reqs, routing="given", distinct=[40] * moe)
    alone = meter_union_verify(cfg, p, specs, 0, reqs[:1], routing="given", distinct=[40] * moe)
    weights = lambda recs: sum(r.weight_read for r in recs if r.op != "embed")      # noqa: E731  (embed: a row a token)
    assert weights(union) == weights(alone)                                         # one read of every weight
    N, Rl, Dr = p["per_rank"]["heads"], cfg.kv_lora_rank, cfg.qk_rope_head_dim
    want = cfg.num_hidden_layers * sum((T + q) * (Rl + Dr) * 2 + q * N * (Rl + Dr) * 2 + 4 + q * -(-q // 32) * 4
                                       for T, q in reqs)
    got = sum(r.read for r in union if r.op == "mla_tree_attention_requests")
    assert got == want
    # the union part is the step-of-requests meter's (its heads are per request; here head_logits once)
    step = meter_step_requests(cfg, dcfg, p, specs, 0, [(T, q - 1) for T, q in reqs])
    kinds = ("embed", "dense_layer", "moe_layer")
    pick = lambda recs: [(r.op, r.read, r.written, r.flops) for r in recs if r.kind in kinds]   # noqa: E731
    plain = meter_union_verify(cfg, p, specs, 0, reqs)
    assert pick(plain) == pick(step) and {r.kind for r in plain if r.kind not in kinds} == {"head"}


def test_the_memory_plan_refuses_before_allocating(kimi):
    from ddtree.bench.step_requests import cache_rows, check_memory, memory_plan
    cfg, dcfg, plan, _ = kimi
    rows = cache_rows([4096, 1024], [8, 4])
    assert rows == 4105
    mem = memory_plan(cfg, dcfg, plan, 70 << 30, 4, rows)
    assert mem["target caches"] == 4 * cfg.num_hidden_layers * rows * 576 * 2
    need = sum(mem.values())
    check_memory(mem, need, "H100", 4, rows)                  # exactly fits
    with pytest.raises(click.ClickException, match="--requests 4: 4 target caches of 4105 rows"):
        check_memory(mem, need - 1, "H100", 4, rows)


def test_rows_from_a_fake_timer(kimi):
    """run_requests' rows: the timer's us, R x (budget + 1) rows, the meter's bytes over the ceiling, the ratio to
    the R = 1 row of the same context / budget / routing (a formula of the fake times)."""
    from ddtree.bench.routing import union_routing
    from ddtree.bench.step_requests import run_requests, stated_tree
    cfg, dcfg, plan, specs = kimi
    p = plan.to_dict()
    from ddtree.description.opset import RankLayout
    lay = RankLayout.from_plan(p, 0)
    filled = []
    rank = SimpleNamespace(config=cfg, drafter_config=dcfg, plan_dict=p, specs=specs, lay=lay,
                           fill_caches=filled.append)
    calls = []

    def timer(rank, caches, context, budget, routing, reuse, repeats):
        calls.append((len(caches), context, budget, routing))
        if routing == "router":
            return 50.0 * len(caches) ** 0.5, None
        ids = union_routing(cfg, [stated_tree(budget, dcfg.block_size).parents] * len(caches), routing, reuse)
        d = distinct_per_layer(ids)
        return 100.0 * len(caches) ** 0.5, {"mean": float(d.mean()), "per_layer": d.tolist()}
    rows = run_requests(rank, ["c0", "c1", "c2", "c3"], [1, 2, 4], [512], [8], [("uniform", None), ("router", None)],
                        3, 2000.0, timer=timer)
    assert filled == [512] and [c[0] for c in calls] == [1, 2, 4, 1, 2, 4]
    for r in rows:
        assert r["rows"] == 9 * r["requests"] and r["context"] == 512 and r["budget"] == 8
        base = 100.0 if r["routing"] == "uniform" else 50.0
        assert r["verify_us"] == base * r["requests"] ** 0.5
        assert r["ratio_to_1"] == pytest.approx(r["requests"] ** 0.5)
        kw = ({"routing": "given", "distinct": r["distinct_experts"]["per_layer"]} if r["routing"] == "uniform"
              else {})
        t = totals(meter_union_verify(cfg, p, specs, 0, [(512, 9)] * r["requests"], **kw))
        assert r["bytes"] == t["read"] + t["written"]
        assert r["pct_roofline"] == pytest.approx(100 * r["bytes"] / 2e6 / r["verify_us"])
    uniform = [r for r in rows if r["routing"] == "uniform"]
    assert [r["distinct_experts"]["mean"] > 8 for r in uniform] == [True] * 3          # k = 8 experts per row
    assert uniform[0]["bytes"] < uniform[1]["bytes"] < uniform[2]["bytes"]
    assert rows[3]["routing"] == "router (random weights)" and rows[3]["distinct_experts"] is None
