"""CPU tests: the tree-form plan chooser (plugins/mla_attention.py tree_cost, fitted_tree_plan) against the
H200 sweep it was fitted on (tests/fixtures/plugins/attention_sweep_h200.json: every tree variant at 0.5, 1
and 2 x the wave model's splits, T 4096 .. 131072, 8, 17 and 33 tokens x 8 heads; written by
tests/plugins/sweep_attention.py on the device)."""
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from ddtree.plugins.mla_attention import TREE_FIT_ROWS, fitted_tree_plan, plan_attention, qreg_default, tree_cost

H200 = dict(sm_count=132, smem_limit=232448)
KIMI = dict(latent=512, rope=64)
SWEEP = json.loads((Path(__file__).parents[1] / "fixtures" / "plugins" / "attention_sweep_h200.json").read_text())


def modelled(r: dict) -> float:
    return tree_cost(r["warps"], r["stages"], r["row_groups"], r["prefix_splits"], r["T"], r["q"],
                     r["q"] * r["heads"], **H200, **KIMI)


def shapes(form: str) -> dict:
    by_shape = defaultdict(list)
    for r in SWEEP["rows"]:
        if r["form"] == form:
            by_shape[(r["T"], r["q"], r["heads"])].append(r)
    return by_shape


def test_tree_cost_follows_the_sweep():
    """The fit is what it says: relative error rms <= 8 % over the 135 tree plans, and the plans that ran in
    one wave (the ones a chooser would take) within 20 % each."""
    rows = [r for r in SWEEP["rows"] if r["form"] == "tree"]
    rel = np.array([modelled(r) / r["us"] - 1 for r in rows])
    assert len(rows) >= 130 and np.sqrt((rel ** 2).mean()) <= 0.08
    one_wave = [abs(e) for e, r in zip(rel, rows)
                if r["row_tiles"] * (r["prefix_splits"] + r["tree_own"]) <= 2 * H200["sm_count"]]
    assert max(one_wave) <= 0.2


def test_tree_cost_ranks_the_swept_plans_like_the_device():
    """At every swept shape the plan tree_cost ranks first ran within 3 % of the fastest swept plan (the
    wave model before it: 21 % off at 136 rows x 4096 keys)."""
    for (T, q, heads), rows in shapes("tree").items():
        best = min(r["us"] for r in rows)
        ranked_first = min(rows, key=modelled)
        assert ranked_first["us"] <= 1.03 * best, (T, q, ranked_first, best)


def test_chosen_tree_plans_are_the_fitted_argmin():
    """plan_attention takes fitted_tree_plan's variant and splits up to TREE_FIT_ROWS rows, and nothing swept
    is modelled cheaper (where tree_qreg is not the default); past TREE_FIT_ROWS (not swept) the older rule
    stands (64-row blocks of 8 warps)."""
    for (T, q, heads), rows in shapes("tree").items():
        if qreg_default(q * heads, T, H200["smem_limit"], KIMI["latent"]):
            continue
        p = plan_attention(q, heads, T, **H200, **KIMI)
        cost = tree_cost(p.warps, p.stages, p.row_groups, p.prefix_splits, T, q, q * heads, **H200, **KIMI)
        assert p.form == "tree" and cost <= min(modelled(r) for r in rows) + 1e-9
    big = plan_attention(64, 8, 32768, **H200, **KIMI)
    assert 64 * 8 > TREE_FIT_ROWS and (big.warps, big.row_groups) == (8, 8)


def test_forced_knobs_restrict_the_fitted_choice():
    fits = [(2, 2, 2), (4, 2, 4), (4, 3, 4)]
    assert fitted_tree_plan(fits, 17, 136, 32768, **H200, **KIMI, warps=4, stages=None, row_groups=None,
                            splits=None)[0] == 4
    assert fitted_tree_plan(fits, 17, 136, 32768, **H200, **KIMI, warps=None, stages=3, row_groups=None,
                            splits=None)[:3] == (4, 3, 4)
    assert fitted_tree_plan(fits, 17, 136, 32768, **H200, **KIMI, warps=None, stages=None, row_groups=None,
                            splits=7)[3] == 7
    assert fitted_tree_plan(fits, 17, 136, 32768, **H200, **KIMI, warps=8, stages=None, row_groups=None,
                            splits=None) is None
    p = plan_attention(17, 8, 32768, **H200, **KIMI, warps=2)
    assert (p.warps, p.row_groups) == (2, 2)


def test_decode_plans_are_the_swept_best():
    """The decode form's wave model (unchanged) picks the faster of the swept split counts (P and P / 2)."""
    for (T, q, heads), rows in shapes("decode").items():
        p = plan_attention(q, heads, T, **H200, **KIMI)
        if p.form != "decode":
            continue
        best = min(rows, key=lambda r: r["us"])
        assert (p.warps, p.stages, p.prefix_splits) == (best["warps"], best["stages"], best["prefix_splits"]), (T, q)


@pytest.mark.parametrize("T", [1, 100, 4096, 32768, 131072])
def test_tree_plans_stay_within_two_waves(T):
    for q in range(5, 34):
        p = plan_attention(q, 8, T, **H200, **KIMI)
        blocks = p.row_tiles * p.splits
        assert blocks <= 2 * 2 * H200["sm_count"] and p.prefix_splits <= max(1, math.ceil(T / 64))


def test_forced_warps_that_do_not_fit_are_refused_by_name():
    """sm_120's 99 KB holds no 8-warp tree variant at Kimi's dims: forcing one names the limit (an IndexError
    before)."""
    with pytest.raises(ValueError, match="no compiled 'tree' variant of 8 warps fits 101376 B of shared memory"):
        plan_attention(17, 8, 4096, sm_count=188, smem_limit=101376, **KIMI, warps=8)
