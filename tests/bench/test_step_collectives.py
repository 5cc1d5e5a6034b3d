"""--collectives pcie's arithmetic on the CPU: the modelled time of a step's collectives is the projection's
collective term (one fit, two users), the hidden fraction is 1 - growth / modelled, bench project scales its
collective term by what is not hidden, and each decoder layer asks for the next layer's attention weights beside
its MLP all-reduce."""
import json

import pytest

from ddtree.backends.meter import MeterOps, meter_step
from ddtree.bench.bench_ops import PcieCollective
from ddtree.bench.projection import ALLREDUCE_CHOICES, HAND_SPLIT, PRO_6000, Projection, load_hidden
from ddtree.bench.step_collectives import hidden_rows, modelled_us
from ddtree.builder.plan import make_plan
from ddtree.builder.weights import rank_tensor_specs
from ddtree.description import layers
from ddtree.description.opset import RankLayout
from ddtree.model.presets import get_preset

TP = 8


@pytest.fixture(scope="module")
def kimi():
    cfg, dcfg = get_preset("kimi-k2.6", layers=3)
    plan = make_plan(cfg, dcfg, TP)
    return cfg, dcfg, plan, rank_tensor_specs(plan)


def pcie(allreduce: str) -> PcieCollective:
    c = object.__new__(PcieCollective)                       # the pricing alone: no GPU, no kernel
    c.tp, c.models, c.allreduce = TP, ALLREDUCE_CHOICES[allreduce], allreduce
    return c


@pytest.mark.parametrize("allreduce", ["auto", "one-shot", "nccl"])
@pytest.mark.parametrize("budget", [8, 16])
def test_the_modelled_time_is_the_projections_collective_term(kimi, allreduce, budget):
    cfg, dcfg, plan, specs = kimi
    recs = meter_step(cfg, dcfg, plan.to_dict(), specs, 0, 4096, budget)
    proj = Projection(PRO_6000, HAND_SPLIT, ALLREDUCE_CHOICES[allreduce], TP)
    assert modelled_us(pcie(allreduce), recs, TP) == pytest.approx(proj.step(recs)["split_us"]["allreduce"], rel=1e-12)
    # an all-reduce of one verify: the one-shot line at (budget + 1) rows of 7168 bf16, 7/8 of it crossing
    message = (budget + 1) * cfg.hidden_size * 2
    assert pcie("one-shot").modelled_us(message) == pytest.approx(7.96 + message * 7 / 8 / 3480, rel=1e-9)
    assert modelled_us(object(), recs, TP) is None                  # copy stand-ins model nothing


def row(collectives, step_us, modelled=None, budget=8):
    return {"context": 4096, "budget": budget, "routing": "uniform", "reuse": None, "collectives": collectives,
            "step_us": step_us, "collectives_modelled_us": modelled}


def test_hidden_fraction_is_one_minus_growth_over_modelled():
    rows = [row("copy", 10_000.0), row("pcie", 12_000.0, 5_000.0), row("copy", 20_000.0, budget=16),
            row("pcie", 25_000.0, 5_000.0, budget=16), row("pcie", 1.0, 1.0, budget=32)]      # no copy twin: none
    got = hidden_rows(rows)
    assert [(h["budget"], h["grown_us"]) for h in got] == [(8, 2000.0), (16, 5000.0)]
    assert [h["hidden_fraction"] for h in got] == pytest.approx([0.6, 0.0])


def test_project_takes_the_measured_hidden_fraction(kimi, tmp_path):
    cfg, dcfg, plan, specs = kimi
    path = tmp_path / "step.json"
    path.write_text(json.dumps({"device": "H200", "hidden": [
        {**row("pcie", 0), "hidden_fraction": 0.3}, {**row("pcie", 0, budget=16), "hidden_fraction": 0.5}]}))
    f, source = load_hidden(path)
    assert f == pytest.approx(0.4) and str(path) in source
    recs = meter_step(cfg, dcfg, plan.to_dict(), specs, 0, 4096, 8)
    whole = Projection(PRO_6000, HAND_SPLIT, ALLREDUCE_CHOICES["auto"], TP).step(recs)
    part = Projection(PRO_6000, HAND_SPLIT, ALLREDUCE_CHOICES["auto"], TP, f, source).step(recs)
    assert part["split_us"]["allreduce"] == pytest.approx(0.6 * whole["split_us"]["allreduce"])
    assert whole["step_us"] - part["step_us"] == pytest.approx(0.4 * whole["split_us"]["allreduce"])
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(Exception, match="no 'hidden' rows"):
        load_hidden(path)


class PrefetchLog(MeterOps):
    def prefetch(self, *names, beside="attention"):
        self.asked.append((beside, names))


def test_each_layer_offers_the_next_attention_beside_its_experts_and_its_mlp_all_reduce(kimi):
    cfg, _, plan, specs = kimi
    for L in range(cfg.num_hidden_layers):
        ops = PrefetchLog(RankLayout.from_plan(plan.to_dict(), 0), specs, {"q": 9, "T": 4096, "S": 4105, "W": 1})
        ops.asked = []
        layers.decoder_layer(ops, cfg, L, plan.moe_inter)
        beside = dict(ops.asked)
        nxt = f"model.layers.{L + 1}.self_attn."
        want = () if L + 1 == cfg.num_hidden_layers else tuple(nxt + n for n in (
            "kv_b_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "q_a_proj.weight"))
        assert beside["collective"] == want
        assert beside["experts"] == want                              # the other site (the backend picks one)
        assert [b for b, _ in ops.asked].index("experts") < [b for b, _ in ops.asked].index("collective")
        assert all(n in specs for n in want)                          # real tensors of the rank
        assert "attention" in beside                                  # the attention-side prefetch stays


def test_hidden_rows_keep_pruned_rows_apart():
    rows = [{"context": 4096, "budget": 16, "routing": "uniform", "reuse": None, "prune": p, "collectives": c,
             "step_us": us, "collectives_modelled_us": 100.0}
            for p, c, us in (("off", "copy", 1000.0), ("auto", "copy", 800.0), ("off", "pcie", 1050.0),
                             ("auto", "pcie", 880.0))]
    got = {r["prune"]: r for r in hidden_rows(rows)}
    assert got["off"]["grown_us"] == 50.0 and got["auto"]["grown_us"] == 80.0
    assert got["off"]["hidden_fraction"] == 0.5 and abs(got["auto"]["hidden_fraction"] - 0.2) < 1e-12
