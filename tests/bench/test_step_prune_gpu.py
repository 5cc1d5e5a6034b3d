"""`ddtree bench step --prune` on one GPU (issue 53): small-mla's tp 2 rank 0 (stand-in collectives), budget 4 under
uniform routing (small-mla has 8 experts, top 2: at budget 16 the 17 nodes' 34 slots leave no expert marginal to one
node, so nothing can be pruned; at budget 4 three of the four drafted nodes hold one at the pruning layer, computed
from bench/routing.py's seeded ids), at a rate so high that every node with a marginal expert goes: each DDTree row
is followed by its pruned twin, whose tree lost nodes, whose MoE layers read fewer distinct experts than the unpruned
tree's, and whose step time and speedup over the unpruned row are reported (only sanity is asserted about the times)."""
import json
import math

import pytest

from ddtree.model.presets import get_preset
from tests.cli.bad_input import ddtree

pytestmark = pytest.mark.gpu


def test_pruned_rows_beside_the_unpruned():
    r = ddtree(["bench", "step", "--preset", "small-mla", "--tp", "2", "--rank", "0", "--context", "256", "--budget",
                "4", "--routing", "uniform", "--prune", "--prune-rate", "1e-4", "--repeats", "3", "--json"],
               timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])["rows"]
    assert [(row["budget"], row["prune"]) for row in rows] == [(4, "off"), (4, "auto")]
    off, on = rows
    p = on["pruned"]
    assert "pruned" not in off and p["rate"] == pytest.approx(1e-4) and p["rate_source"] == "given"
    assert p["rate_basis"] == "given"
    assert 0 < p["pruned_nodes"] <= 4
    assert p["distinct_experts_after"] < p["distinct_experts_before"]
    assert p["distinct_experts_before"] == pytest.approx(off["distinct_experts"]["mean"])   # the same given routing
    assert math.isfinite(p["speedup"]) and p["speedup"] > 0 and on["step_us"] > 0
    assert 1.0 <= p["expected_accept_after"] < p["expected_accept_before"] <= 5.0     # nodes gone: acceptance lost
    assert p["tokens_per_s_ratio"] == pytest.approx(
        off["step_us"] / on["step_us"] * p["expected_accept_after"] / p["expected_accept_before"], rel=1e-12)
    print(json.dumps(p, indent=1), off["step_us"], on["step_us"])


def test_calibrated_rate_prices_the_second_row_by_the_first():
    """--prune-rate calibrated: the measured-rate row, then (where it saved time and experts) a row whose expert is
    priced at the us the first saved per expert-layer; else the first row says why there is no second."""
    r = ddtree(["bench", "step", "--preset", "small-mla", "--tp", "2", "--rank", "0", "--context", "256", "--budget",
                "4", "--routing", "uniform", "--prune", "--prune-rate", "calibrated", "--repeats", "3", "--json"],
               timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])["rows"]
    off, first = rows[:2]
    p = first["pruned"]
    assert p["rate_basis"] == "measured" and p["rate_source"] == "given per expected token"
    moe_layers = len(get_preset("small-mla")[0].moe_layers)
    assert p["removed_expert_layers"] == pytest.approx(
        (p["distinct_experts_before"] - p["distinct_experts_after"]) * moe_layers, rel=1e-12)
    expected = p["expected_saving_expert_layers"]
    assert expected >= 0 and (p["pruned_nodes"] or not expected)
    if len(rows) == 2:
        assert p["calibration"].startswith("none") and (expected <= 0 or off["step_us"] <= first["step_us"])
        return
    second = rows[2]["pruned"]
    assert second["rate_basis"] == "calibrated" and expected > 0
    assert second["expert_us"] == pytest.approx((off["step_us"] - first["step_us"]) / expected, rel=1e-9)
