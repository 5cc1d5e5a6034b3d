"""ddtree bench project --measured-step: the projection corrected by a measured H200 or H100 step. A step measured at
exactly the model's time on its card leaves the projection unchanged; one measured at twice it doubles the compute
side and keeps the modelled collectives; a file that is not a bench step, or one from a card the model cannot price,
is refused naming the flag."""
import json

import pytest

from ddtree.bench.projection import H100, H200, HAND_SPLIT, Projection
from ddtree.bench.step_correction import NO_COLLECTIVES
from tests.cli.bad_input import ddtree, refuses


def modelled_h200_us(context: int, budget: int, dev=H200) -> float:
    from ddtree.backends.meter import meter_step
    from ddtree.builder.plan import make_plan
    from ddtree.builder.weights import rank_tensor_specs
    from ddtree.model.presets import get_preset
    cfg, dcfg = get_preset("kimi-k2.6", 61)
    plan = make_plan(cfg, dcfg, 8)
    recs = meter_step(cfg, dcfg, plan.to_dict(), rank_tensor_specs(plan), 0, context, budget)
    return Projection(dev, HAND_SPLIT, NO_COLLECTIVES, 8).step(recs)["step_us"]


# each card priced once, each scale once (a CLI subprocess each, ~3 s): identity on one card, doubling on the other
@pytest.mark.parametrize("scale,card,dev", [(1.0, "NVIDIA H200 (test)", H200), (2.0, "NVIDIA H100 80GB HBM3", H100)])
def test_the_correction_scales_the_compute_side_only(tmp_path, scale, card, dev):
    model = modelled_h200_us(4096, 16, dev)
    f = tmp_path / "step.json"
    f.write_text(json.dumps({"device": card, "rows": [{"context": 4096, "budget": 16, "routing": "router (x)",
                                                          "reuse": None, "step_us": scale * model + 300.0,
                                                          "split_us": {"allreduce_standin": 300.0}}]}))
    r = ddtree(["bench", "project", "--routing", "uniform", "--budget", "16", "--context", "4096", "--json",
                "--measured-step", str(f)])
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["rows"][0]["projection"]
    c = p["measured_correction"]
    coll = p["split_ms"]["allreduce"]
    assert c["factor"] == pytest.approx(scale, rel=1e-9) and c["priced_on"] == dev.name
    assert c["model_us"] == pytest.approx(model, rel=1e-12)
    assert c["step_ms"] == pytest.approx((p["step_ms"] - coll) * scale + coll, rel=1e-9)
    assert c["tokens_per_s"] == pytest.approx(p["accept_len"] / (c["step_ms"] * 1e-3), rel=1e-9)


def test_not_a_step_file_is_refused(tmp_path):
    f = tmp_path / "x.json"
    f.write_text("{}")
    refuses(["bench", "project", "--measured-step", str(f)], "--measured-step", "ddtree bench step --json", code=2)


def test_a_step_from_a_card_the_model_cannot_price_is_refused(tmp_path):
    f = tmp_path / "step.json"
    f.write_text(json.dumps({"device": "NVIDIA A100-SXM4-80GB", "rows": [
        {"context": 4096, "budget": 16, "routing": "uniform", "reuse": None, "step_us": 1e4, "split_us": {}}]}))
    refuses(["bench", "project", "--measured-step", str(f)], "--measured-step", "A100", code=2)


def test_a_pruned_row_gives_its_unpruned_row_a_pruned_projection(tmp_path):
    """bench step --prune files: the pruned row does not replace the unpruned one (whose correction is as without it);
    the corrected row gets the pruned step = the corrected step / the measured speedup, at the same accepted length."""
    model = modelled_h200_us(4096, 16)
    unpruned = {"context": 4096, "budget": 16, "routing": "uniform", "reuse": None, "prune": "off",
                "step_us": 2 * model + 300.0, "split_us": {"allreduce_standin": 300.0}}
    stats = {"speedup": 1.25, "pruned_nodes": 5, "distinct_experts_before": 116.0, "distinct_experts_after": 90.0,
             "rate": 1.3e-10}
    pruned = {**unpruned, "prune": "auto", "step_us": (2 * model + 300.0) / 1.25, "pruned": stats}
    f = tmp_path / "step.json"
    f.write_text(json.dumps({"device": "NVIDIA H200 (test)", "rows": [unpruned, pruned]}))
    r = ddtree(["bench", "project", "--routing", "uniform", "--budget", "16", "--context", "4096", "--json",
                "--measured-step", str(f)])
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["rows"][0]["projection"]
    c = p["measured_correction"]
    assert c["factor"] == pytest.approx(2.0, rel=1e-9)                   # the unpruned row's, not the pruned one's
    q = c["pruned"]
    assert q["step_ms"] == pytest.approx(c["step_ms"] / 1.25, rel=1e-9) and q["accept_len"] == p["accept_len"]
    assert q["tokens_per_s"] == pytest.approx(1.25 * c["tokens_per_s"], rel=1e-9)
    assert {k: q[k] for k in stats} == stats and "accepted length" in q["assumption"]
