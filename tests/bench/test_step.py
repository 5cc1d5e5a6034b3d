"""ddtree bench step on the CPU: the split's kernel families, flag errors before any GPU is touched, and the
synthetic rank's device bytes against the engine's rank files (the same tensors, the kernels' layouts)."""
import pytest

from ddtree.bench.step import kernel_family
from tests.cli.bad_input import refuses


def rec(kernel, fn="decoder_layer", tag="", n=None):
    args = (0, 0, 0, 0, 0, 0, 1, n, 7168) if n is not None else ()
    return {"kernel": kernel, "fn": fn, "tag": tag, "launch": (None, 1, 1, 0, args)}


@pytest.mark.parametrize("r,family", [
    (rec("gemm_bf16_mt1", n=20480), "lm_head"), (rec("gemm_bf16_mt1", fn="draft_logits", n=20480), "lm_head"),
    (rec("gemm_bf16_mt1", n=384), "router"), (rec("moe_route"), "router"), (rec("router_fused_mt3"), "router"),
    (rec("moe_gate_up_r4c2"), "moe"), (rec("moe_stream_r4c2"), "moe"),
    (rec("moe_down_r4c2"), "moe"), (rec("mla_attention_w4_s3"), "attention"), (rec("kv_append"), "attention"),
    (rec("gemm_bf16_mt2", n=1536), "dense"), (rec("mla_absorb_mt1"), "dense"),
    (rec("gemm_bf16_mt1", fn="draft_layer", n=1024), "drafter"), (rec("draft_attention_d128", fn="draft_layer"), "drafter"),
    (rec("draft_topk", fn="draft_logits"), "tree"), (rec("sample_greedy", fn="head_logits"), "tree"),
    (rec("kv_compact", fn="compact"), "tree"), (rec("gather_rows", tag="allreduce_standin"), "allreduce_standin"),
    (rec("rms_norm_rows"), "other"), (rec("l2_prefetch"), "prefetch"), (rec("l2_prefetch", fn="draft_layer"), "prefetch"),
])
def test_kernel_families(r, family):
    assert kernel_family(r, 20480, 384) == family


def test_top_kernels_group_launches_by_shape():
    """Same kernel, function and grid: one row with its launches counted and their times summed; another grid or
    function is another row; rows by total time, largest first (a brute-force sum over the launches)."""
    from ddtree.bench.step_parts import top_kernels

    def launch(kernel, grid, fn="decoder_layer", n=1536):
        r = rec(kernel, fn=fn, n=n)
        r["launch"] = (None, grid, (128, 1, 1), 1024, r["launch"][4])
        return r
    launches = [launch("gemm_bf16_mt1", (1, 2, 48)), launch("mla_absorb_mt1", (8, 1, 1)), launch("gemm_bf16_mt1", (1, 2, 48)),
                launch("gemm_bf16_mt1", (1, 4, 48)), launch("gemm_bf16_mt1", (1, 2, 48), fn="draft_layer"),
                launch("rms_norm_rows", 17)]                           # an int grid, as launches take it
    times = [3.0, 5.0, 4.0, 1.5, 2.0, 0.5]
    rows = top_kernels(launches, times, 20480, 384)
    got = [(r["kernel"], r["fn"], tuple(r["grid"]), r["launches"], r["us_total"], r["part"]) for r in rows]
    assert got == [("gemm_bf16_mt1", "decoder_layer", (1, 2, 48), 2, 7.0, "dense"),
                   ("mla_absorb_mt1", "decoder_layer", (8, 1, 1), 1, 5.0, "dense"),
                   ("gemm_bf16_mt1", "draft_layer", (1, 2, 48), 1, 2.0, "drafter"),
                   ("gemm_bf16_mt1", "decoder_layer", (1, 4, 48), 1, 1.5, "dense"),
                   ("rms_norm_rows", "decoder_layer", (17,), 1, 0.5, "other")]
    assert rows[0]["us_each"] == 3.5 and len(top_kernels(launches, times, 20480, 384, top=2)) == 2


def test_flag_errors_name_the_flag():
    refuses(["bench", "step", "--budget", "0,4"], "--budget", code=2)
    refuses(["bench", "step", "--context", "4k"], "--context", code=2)
    refuses(["bench", "step", "--tp", "8", "--rank", "8"], "--rank", code=2)
    refuses(["bench", "step", "--accept", "0"], "--accept", code=2)
    refuses(["bench", "step", "--tp", "2", "--ranks", "all", "--rank", "1"], "--ranks all runs every rank", code=2)
    refuses(["bench", "step", "--tp", "2", "--ranks", "all", "--gpu", "0,1,2"], "3 GPU index(es) for tp 2", code=2)
    refuses(["bench", "step", "--tp", "2", "--ranks", "all", "--gpu", "0,x"], "--gpu", code=2)
    refuses(["bench", "step", "--tp", "2", "--gpu", "0,1"], "--ranks one runs on one GPU", code=2)
    refuses(["bench", "step", "--gpu", "-1"], "--gpu", code=2)


def test_all_ranks_summary_is_per_row_across_ranks():
    """bench/step_ranks.py summarize: each row's per-rank medians in rank order, the skew (slowest - fastest with the
    collectives), rank 0's collective cost (with - single-rank) and the step = the slowest rank."""
    from ddtree.bench.step_ranks import summarize
    rows = [(4096, None, "router", None), (4096, 16, "tree", 0.5)]
    infos = [{"rows": rows, "single_us": [100.0, 1000.0], "with_collectives_us": [130.0, 1200.0]},
             {"rows": rows, "single_us": [104.0, 990.0], "with_collectives_us": [128.0, 1260.0]}]
    ar, dd = summarize(infos)
    assert (ar["mode"], ar["budget"], dd["mode"], dd["budget"], dd["reuse"]) == ("ar", None, "ddtree", 16, 0.5)
    assert ar["single_rank_us"] == [100.0, 104.0] and ar["with_collectives_us"] == [130.0, 128.0]
    assert (ar["skew_us"], ar["single_rank_spread_us"], ar["collectives_us_rank0"], ar["step_us"]) == (2.0, 4.0, 30.0, 130.0)
    assert (dd["skew_us"], dd["collectives_us_rank0"], dd["step_us"]) == (60.0, 200.0, 1260.0)


def test_synthetic_weights_bytes_are_the_engine_ranks():
    """Kimi K2.6, 2 layers, tp 8: the filled buffers hold every rank tensor (GEMMs tiled to 16 rows, W_UK^T
    added), so their bytes are the rank files' plus exactly those extras."""
    from ddtree.bench.synthetic_rank import SyntheticWeights
    from ddtree.builder.plan import make_plan
    from ddtree.builder.weights import rank_tensor_specs
    from ddtree.model.presets import get_preset
    cfg, dcfg = get_preset("kimi-k2.6", 2)
    specs = rank_tensor_specs(make_plan(cfg, dcfg, 8))
    stored = sum(s.nbytes for s in specs.values())
    extra = sum(s.nbytes // 2 for n, s in specs.items() if n.endswith("kv_b_proj.weight"))
    pad = sum((-(-s.shape[0] // 16) * 16 - s.shape[0]) * s.shape[1] * 2 for n, s in specs.items()
              if len(s.shape) == 2 and n.endswith(("proj.weight", "gate.weight", "lm_head.weight", "fc.weight"))
              and not n.endswith("kv_b_proj.weight"))
    assert SyntheticWeights.plan_bytes(specs) == stored + extra + pad


def test_routing_flags():
    from ddtree.bench.step import parse_routing
    assert parse_routing("router,tree", "0,0.5") == [("router", None), ("tree", 0.0), ("tree", 0.5)]
    refuses(["bench", "step", "--routing", "random"], "--routing", code=2)
    refuses(["bench", "step", "--routing", "tree", "--reuse", "1.5"], "--reuse", code=2)


def test_given_routing_writes_the_generators_ids_for_the_stated_tree():
    """What the MoE will use, per MoE layer: bench/routing.py's ids for the budget's stated tree, weights
    routed_scaling_factor / k; the distinct experts reported are those ids' (no GPU: a recording stand-in)."""
    from types import SimpleNamespace

    import numpy as np

    from ddtree.bench.project import DraftProfile
    from ddtree.bench.routing import distinct_per_layer, routing_ids
    from ddtree.bench.step_rows import given_routing
    from ddtree.model.presets import get_preset

    class Host:                                   # the Gpu calls given_routing makes, on numpy arrays
        def zeros(self, shape, dtype):
            return np.zeros(shape, dtype)

        def alloc(self, shape, dtype):
            return np.empty(shape, dtype)

        def copy_in(self, dst, a):
            dst[: len(a)] = a
    cfg, dcfg = get_preset("kimi-k2.6", 3)
    rank = SimpleNamespace(config=cfg, drafter_config=dcfg, gpu=Host(), routing_buffers=None,
                           ops=SimpleNamespace(max_tokens=256, routing=None))
    d = given_routing(rank, 16, "tree", 0.5, seed=3)
    tree = DraftProfile().tree(16, dcfg.block_size - 1)
    want = routing_ids("tree", tree.parents, cfg.n_routed_experts, cfg.num_experts_per_tok, 0.5,
                       len(cfg.moe_layers), 3)
    for i, L in enumerate(cfg.moe_layers):
        ids, w = rank.ops.routing[f"model.layers.{L}.mlp.gate.weight"]
        assert (ids[:17] == want[i]).all() and np.allclose(w[:17], cfg.routed_scaling_factor / 8)
    assert d["mean"] == distinct_per_layer(want).mean()
    assert given_routing(rank, 16, "router", None) is None and rank.ops.routing is None


@pytest.mark.parametrize("budget", [4, 16, 64])
def test_stated_draft_logits_build_the_stated_tree(budget):
    """The logits bench step copies over the drafter's: the host tree builder (the GPU builder's twin) makes the
    projection's DraftProfile tree from them (the same nodes per depth; which of two equal-probability siblings
    comes first is the rounding's choice), and its first-child chain is long enough for --accept 4."""
    import numpy as np

    from ddtree.bench.project import DraftProfile, depth_histogram
    from ddtree.bench.step_rows import stated_draft_logits
    from ddtree.plugins.step_state import force_accept_ref
    from ddtree.runtime import vocab_parallel
    from ddtree.tree.build import Tree, build_tree
    logits = stated_draft_logits(budget, 7, 20480)
    logp, ids = vocab_parallel.topk_logprobs([logits], [0], budget)
    tree, stated = build_tree(5, logp, ids, budget), DraftProfile().tree(budget, 7)
    assert depth_histogram(Tree.from_parents(tree.parents)) == np.bincount(tree.depth).tolist() \
        == np.bincount(stated.depth).tolist()
    assert len(force_accept_ref(tree.parents, 4)) == 4


def test_every_metered_op_has_the_part_of_its_kernels():
    """meter_family mirrors kernel_family: a Kimi tp 8 step's records land in the parts whose kernels do that work,
    and the parts' ideals add up to the step's bytes at the ceiling."""
    from ddtree.backends.meter import meter_step, totals
    from ddtree.bench.step_parts import SPLIT, meter_family, part_ideals
    from ddtree.builder.plan import make_plan
    from ddtree.builder.weights import rank_tensor_specs
    from ddtree.model.presets import get_preset
    cfg, dcfg = get_preset("kimi-k2.6", layers=3)
    plan = make_plan(cfg, dcfg, 8)
    recs = meter_step(cfg, dcfg, plan.to_dict(), rank_tensor_specs(plan), 0, 4096, 16)
    seen = {}
    for r in recs:
        seen.setdefault(meter_family(r), set()).add((r.kind, r.op))
    assert ("head", "linear") in seen["lm_head"] and ("draft_head", "linear") in seen["lm_head"]
    assert {op for _, op in seen["attention"]} == {"mla_tree_attention", "kv_append_normed"}
    assert {op for _, op in seen["moe"]} == {"moe.experts"} and {op for _, op in seen["router"]} == {"moe.router"}
    assert ("moe_layer", "moe.shared") in seen["dense"] and ("draft_layer", "linear") in seen["drafter"]
    assert {op for _, op in seen["tree"]} == {"vocab_topk", "tree_build", "vocab_winner", "accept_walk", "kv_compact"}
    assert all(k.startswith("draft") for k, _ in seen["drafter"])
    parts = part_ideals(recs, 4000.0, None)
    t = totals(recs)
    assert sum(p["bytes"] for p in parts.values()) == t["read"] + t["written"]
    assert abs(sum(p["ideal_us"] for p in parts.values()) - (t["read"] + t["written"]) / 4e6) < 1e-6
    flops = part_ideals(recs, 4000.0, 1e-3)              # a tiny peak: every part with FLOPs is compute-bound
    assert all(p["ideal_us"] == p["flops"] / 1e3 for p in flops.values() if p["flops"] > 0)
    assert set(parts) == set(SPLIT)


def test_row_cases_are_per_context_the_ar_step_then_every_budget_and_routing():
    from ddtree.bench.step_rows import row_cases
    cases = [("uniform", None), ("tree", 0.5)]
    assert row_cases([4096, 32768], [16, 64], cases, True) == [
        (4096, None, "router", None), (4096, 16, "uniform", None), (4096, 16, "tree", 0.5),
        (4096, 64, "uniform", None), (4096, 64, "tree", 0.5),
        (32768, None, "router", None), (32768, 16, "uniform", None), (32768, 16, "tree", 0.5),
        (32768, 64, "uniform", None), (32768, 64, "tree", 0.5)]
    assert row_cases([4096], [16], cases[:1], False) == [(4096, 16, "uniform", None)]


def test_prune_flags_and_the_bench_pruner():
    """--prune runs on --ranks one (refused by name on all); the bench's Pruner prices an expert at the rank's own
    bytes: Kimi's tp 8 expert slice is the 3,096,576 bytes tree/prune.py's DEFAULT_RATE assumes."""
    from types import SimpleNamespace

    from ddtree.bench.step_rows import bench_pruner
    from ddtree.builder.plan import make_plan
    from ddtree.builder.weights import rank_tensor_specs
    from ddtree.description.opset import RankLayout
    from ddtree.model.presets import get_preset
    from ddtree.tree.prune import DEFAULT_RATE_PER_TOKEN, KIMI_EXPERT_BYTES
    refuses(["bench", "step", "--tp", "2", "--ranks", "all", "--prune"], "--prune", "--ranks one", code=2)
    refuses(["bench", "step", "--prune", "--prune-rate", "-1"], "--prune-rate", code=2)
    cfg, dcfg = get_preset("kimi-k2.6", 3)
    plan = make_plan(cfg, dcfg, 8)
    rank = SimpleNamespace(config=cfg, specs=rank_tensor_specs(plan), lay=RankLayout.from_plan(plan.to_dict(), 0))
    pruner = bench_pruner(rank, None)
    assert pruner.expert_bytes == KIMI_EXPERT_BYTES and pruner.rate_terms(16, 4096) == (0.0, DEFAULT_RATE_PER_TOKEN)
    assert bench_pruner(rank, 1e-9).rate_terms(16, 4096) == (1e-9, 0.0)


def test_the_measured_rate_is_the_default_rates_formula_over_the_row():
    """--prune-rate measured: over a row that measured the H200 step DEFAULT_RATE was written from (its step, routed
    experts' us and distinct experts), the rate per token is DEFAULT_RATE_PER_TOKEN (60 MoE layers); it scales as
    1 / step and with the us an expert costs; a row with no routed experts, a word or a rate without --prune are
    refused by name."""
    from types import SimpleNamespace

    import click
    import pytest

    from ddtree.bench.step_rows import bench_pruner, measured_rate_per_token
    from ddtree.builder.plan import make_plan
    from ddtree.builder.weights import rank_tensor_specs
    from ddtree.description.opset import RankLayout
    from ddtree.model.presets import get_preset
    from ddtree.tree import prune as P
    refuses(["bench", "step", "--prune", "--prune-rate", "cheap"], "--prune-rate", "measured", code=2)
    refuses(["bench", "step", "--prune-rate", "measured"], "--prune-rate", "--prune", code=2)
    row = {"budget": 16, "step_us": P.KIMI_STEP_US, "distinct_experts": {"mean": P.KIMI_EXPERTS_READ / 60},
           "parts": {"moe": {"us": P.KIMI_ROUTED_US}}}
    rate = measured_rate_per_token(row, 60, P.KIMI_EXPERT_BYTES)
    assert rate == pytest.approx(P.DEFAULT_RATE_PER_TOKEN, rel=1e-12)
    half = {**row, "step_us": 2 * P.KIMI_STEP_US, "parts": {"moe": {"us": 3 * P.KIMI_ROUTED_US}}}
    assert measured_rate_per_token(half, 60, P.KIMI_EXPERT_BYTES) == pytest.approx(1.5 * rate, rel=1e-12)
    cfg, dcfg = get_preset("kimi-k2.6", 61)
    plan = make_plan(cfg, dcfg, 8)
    rank = SimpleNamespace(config=cfg, specs=rank_tensor_specs(plan), lay=RankLayout.from_plan(plan.to_dict(), 0))
    pruner = bench_pruner(rank, None, row)
    assert pruner.rate_terms(16, 4096) == (0.0, pytest.approx(P.DEFAULT_RATE_PER_TOKEN, rel=1e-12))
    assert pruner.stats.rate_source == "given per expected token"
    with pytest.raises(click.ClickException, match="no routed experts"):
        measured_rate_per_token({**row, "distinct_experts": None}, 60, P.KIMI_EXPERT_BYTES)


def test_the_calibrated_rate_prices_an_expert_at_what_pruning_saved():
    """--prune-rate calibrated: an expert-layer is worth the us the measured-rate row saved per expert-layer the rule
    expected it to save (1219 us over 1849 expert-layers: 0.66 us, against the 1.57 us average the H100 tree-0.5 row's
    measured rate used); nothing expected or nothing saved gives no price; the earnings are the speedup times the
    acceptance kept; 'calibrated' is a --prune-rate word, refused without --prune."""
    import pytest

    from ddtree.bench.step_rows import parse_prune_rate, saved_expert_us, with_earnings
    refuses(["bench", "step", "--prune-rate", "calibrated"], "--prune-rate", "--prune", code=2)
    assert parse_prune_rate("calibrated", True) == "calibrated"
    unpruned = {"step_us": 14281.7}
    pruned = {"step_us": 13062.7, "pruned": {"expected_saving_expert_layers": 1849.0,
                                             "expected_accept_before": 3.491, "expected_accept_after": 2.834}}
    assert saved_expert_us(unpruned, pruned) == pytest.approx(1219.0 / 1849.0, rel=1e-9)
    none = {**pruned, "pruned": {**pruned["pruned"], "expected_saving_expert_layers": 0.0}}
    assert saved_expert_us(unpruned, none) is None
    assert saved_expert_us({"step_us": 13000.0}, pruned) is None               # the pruned row was slower
    p = with_earnings(unpruned, {**pruned, "pruned": dict(pruned["pruned"])})["pruned"]
    assert p["speedup"] == pytest.approx(14281.7 / 13062.7, rel=1e-12)
    assert p["tokens_per_s_ratio"] == pytest.approx(14281.7 / 13062.7 * 2.834 / 3.491, rel=1e-12)


def test_target_terms_are_the_rows_own_overhead_per_layer_and_dense_ratio():
    """Issue 48's targets in a row's numbers: (step - ideal) / layers and the dense part's us over its ideal; the
    H100 AR row of HEAD (docs/measured: 6209 us, ideal 2103, 61 layers, dense 3082 / 1303) is 67 us a layer and
    2.37x; a row without dense work has no ratio."""
    import pytest

    from ddtree.bench.step_parts import target_terms
    t = target_terms(6209.0, 2103.0, {"dense": {"us": 3082.0, "ideal_us": 1303.0}}, 61)
    assert t["overhead_us_per_layer"] == pytest.approx((6209.0 - 2103.0) / 61, rel=1e-12)
    assert 67.0 < t["overhead_us_per_layer"] < 67.5 and t["dense_x_ideal"] == pytest.approx(3082.0 / 1303.0)
    assert target_terms(100.0, 50.0, {"dense": {"us": 1.0, "ideal_us": 0.0}}, 2)["dense_x_ideal"] is None
    assert target_terms(100.0, 50.0, {}, 2) == {"overhead_us_per_layer": 25.0, "dense_x_ideal": None}
