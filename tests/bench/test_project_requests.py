"""`ddtree bench project --requests` (issue 51): the step of R requests at once, projected. R = 1 against today's
one-request row, the union's distinct experts against the meter's expectation and bench step --requests' routing,
tokens/s against their formulas, and the flag's refusals."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from ddtree.backends.meter import expected_distinct, meter_step
from ddtree.backends.meter_requests import meter_step_requests
from ddtree.bench.project import DraftProfile, project_row
from ddtree.bench.project_requests import requests_row, requests_rows
from ddtree.bench.projection import HAND_SPLIT, KIMI_DFLASH_CARD, MODEL_CHOICES, PRO_6000, Projection
from ddtree.bench.routing import distinct_per_layer
from ddtree.builder.plan import make_plan
from ddtree.builder.weights import rank_tensor_specs
from ddtree.cli import main
from ddtree.description.opset import RankLayout
from ddtree.model.presets import get_preset

CONTEXT, BUDGET = 4096, 8


@pytest.fixture(scope="module")
def setup():
    cfg, dcfg = get_preset("kimi-k2.6", 61)
    plan = make_plan(cfg, dcfg, 8)
    model = (cfg, dcfg, plan.to_dict(), rank_tensor_specs(plan), 0)
    proj = Projection(PRO_6000, dict(HAND_SPLIT), MODEL_CHOICES["auto"], 8)
    return model, proj, DraftProfile().tree(BUDGET, dcfg.block_size - 1)


@pytest.fixture(scope="module")
def rows(setup):
    model, proj, tree = setup
    return requests_rows(model, proj, KIMI_DFLASH_CARD, [CONTEXT], [BUDGET], [("uniform", None), ("tree", 0.5)],
                         {BUDGET: tree}, 3, [1, 2, 4])


def test_one_request_meters_todays_step(setup):
    cfg, dcfg, plan, specs, _ = setup[0]
    assert meter_step_requests(cfg, dcfg, plan, specs, 0, [(CONTEXT, BUDGET)]) == \
        meter_step(cfg, dcfg, plan, specs, 0, CONTEXT, BUDGET)


@pytest.mark.parametrize("routing, reuse", [("uniform", None), ("tree", 0.5)])
def test_r1_row_is_todays_row_bit_for_bit(setup, routing, reuse):
    model, proj, tree = setup
    today = project_row(model, proj, KIMI_DFLASH_CARD, CONTEXT, BUDGET, routing, reuse, tree, 3)
    one = requests_row(model, proj, KIMI_DFLASH_CARD, CONTEXT, BUDGET, routing, reuse, tree, 3, 1)
    added = one["projection"].pop("aggregate_tokens_per_s")
    assert (one.pop("requests"), one.pop("union_rows")) == (1, BUDGET + 1)
    assert one == today
    assert added == pytest.approx(today["projection"]["tokens_per_s"], rel=1e-12)    # R x accept / step: rounding


def test_tokens_per_s_follow_their_formulas(rows):
    by = {(r["routing"], r["requests"]): r for r in rows}
    assert sorted(by) == [(r, R) for r in ("tree", "uniform") for R in (1, 2, 4)]
    for routing in ("uniform", "tree"):
        one = by[routing, 1]["projection"]
        for R in (1, 2, 4):
            r = by[routing, R]
            p, step_us = r["projection"], 1e3 * r["projection"]["step_ms"]
            assert r["union_rows"] == R * (BUDGET + 1)
            assert p["aggregate_tokens_per_s"] == pytest.approx(R * p["accept_len"] / step_us * 1e6, rel=1e-12)
            assert p["tokens_per_s"] == pytest.approx(p["accept_len"] / step_us * 1e6, rel=1e-12)
            assert r["ratio_to_1"]["aggregate_tokens_per_s"] == pytest.approx(
                p["aggregate_tokens_per_s"] / one["aggregate_tokens_per_s"])
            assert r["ratio_to_1"]["step"] == pytest.approx(p["step_ms"] / one["step_ms"])
            if R > 1:
                assert p["aggregate_tokens_per_s"] > one["aggregate_tokens_per_s"]
                assert p["tokens_per_s"] < one["tokens_per_s"]
                assert p["step_ms"] < R * one["step_ms"]      # the union shares the weights: less than R steps


def test_the_union_verify_counts_the_union_rows(rows, setup):
    cfg, dcfg = setup[0][:2]
    by = {(r["routing"], r["requests"]): r for r in rows}
    one = by["uniform", 1]["projection"]
    for R in (2, 4):
        p = by["uniform", R]["projection"]
        biggest = max(c["message_bytes"] for c in p["collectives"] if c["op"] == "all_reduce")
        assert biggest == R * (BUDGET + 1) * cfg.hidden_size * 2           # bf16 rows of the union
        for phase in ("drafter", "lm_head"):                               # R drafters, R heads
            assert p["split_ms"][phase] == pytest.approx(R * one["split_ms"][phase])


@pytest.mark.parametrize("R", [1, 2, 4])
def test_uniform_union_experts_are_the_meters_expectation(setup, rows, R):
    cfg, dcfg, plan, specs, _ = setup[0]
    lay = RankLayout.from_plan(plan, 0)
    want = expected_distinct(lay.expert_stop - lay.expert_start, cfg.n_routed_experts, cfg.num_experts_per_tok,
                             R * (BUDGET + 1))
    recs = meter_step_requests(cfg, dcfg, plan, specs, 0, [(CONTEXT, BUDGET)] * R)
    experts = [r.detail["expected_distinct"] for r in recs if r.op == "moe.experts"]
    assert len(experts) == len(cfg.moe_layers) and experts == [pytest.approx(want, rel=1e-12)] * len(experts)
    row = next(r for r in rows if r["routing"] == "uniform" and r["requests"] == R)
    assert row["distinct_experts"]["mean"] == pytest.approx(want, rel=1e-12)


def test_tree_union_experts_are_bench_step_requests_routing(setup, rows):
    from ddtree.bench.routing import routing_ids
    (cfg, dcfg, plan, _, _), _, tree = setup
    lay = RankLayout.from_plan(plan, 0)
    for R in (2, 4):                            # request i's tree routed with seed 3 + i, the union's rows stacked
        ids = np.concatenate([routing_ids("tree", tree.parents, cfg.n_routed_experts, cfg.num_experts_per_tok, 0.5,
                                          len(cfg.moe_layers), 3 + i) for i in range(R)], axis=1)
        d = distinct_per_layer(ids, (lay.expert_start, lay.expert_stop))
        row = next(r for r in rows if r["routing"] == "tree" and r["requests"] == R)
        assert row["distinct_experts"]["mean"] == pytest.approx(float(d.mean()), rel=1e-12)
        assert (row["distinct_experts"]["min"], row["distinct_experts"]["max"]) == (int(d.min()), int(d.max()))


def project(*args):
    return CliRunner().invoke(main, ["bench", "project", "--context", "4096", "--routing", "uniform", *args])


def test_cli_rows_and_assumptions():
    r = project("--budget", "4,8", "--requests", "4,2", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [(x["budget"], x["requests"]) for x in out["rows"]] == [(4, 2), (4, 4), (8, 2), (8, 4)]
    assert all(x["ratio_to_1"]["aggregate_tokens_per_s"] > 1 for x in out["rows"])   # against an R = 1 not listed
    a = out["assumptions"]["requests"]
    assert a["requests"] == [2, 4] and "one per request" in a["drafter"] and "union" in a["routing"]
    table = project("--budget", "8", "--requests", "1,2")
    assert table.exit_code == 0 and "aggregate tok/s" in table.stdout


@pytest.mark.parametrize("args, names", [
    (["--requests", "0,2"], ["--requests", "1.."]),
    (["--requests", "two"], ["--requests", "integers"]),
    (["--requests", ","], ["--requests", "at least one"]),
    (["--budget", "64", "--requests", "1,4"], ["--requests", "260 union rows", "256"]),
    (["--requests", "2", "--measured-step", "docs/measured/bench_step_kimi_k26_tp8_rank0_h200.json"],
     ["--requests", "--measured-step"]),
])
def test_bad_requests_are_refused_by_name(args, names):
    r = project(*args)
    assert r.exit_code == 2, r.output
    for name in names:
        assert name in r.output
