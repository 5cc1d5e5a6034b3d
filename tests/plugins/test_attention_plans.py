"""CPU tests: the tree-form plan chooser (plugins/mla_attention.py tree_cost, fitted_tree_plan) against the
H200 sweep it was fitted on (tests/fixtures/plugins/attention_sweep_h200.json: every tree variant at 0.5, 1
and 2 x the wave model's splits, T 4096 .. 131072, 8, 17 and 33 tokens x 8 heads; written by
tests/plugins/sweep_attention.py on the device)."""
import itertools
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from ddtree.plugins.mla_attention import TREE_FIT_ROWS, fitted_tree_plan, plan_attention, tree_cost

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
    is modelled cheaper; past TREE_FIT_ROWS (not swept) the older rule stands (64-row blocks of 8 warps)."""
    for (T, q, heads), rows in shapes("tree").items():
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


SM120 = dict(sm_count=188, smem_limit=101376)


def test_cluster_plans_round_splits_to_whole_clusters():
    """slots (grid y) = splits rounded up to whole clusters, one partial per cluster; a tile whose splits fit
    one cluster needs no combine (partials 1); the kernel names say the cluster and the load warp."""
    for splits, cluster, slots, partials in [(1, 4, 4, 1), (3, 4, 4, 1), (4, 4, 8, 2), (7, 8, 8, 1), (8, 8, 16, 2),
                                             (200, 8, 208, 26), (26, 1, 27, 27)]:
        p = plan_attention(17, 8, 4096, **H200, **KIMI, form="tree", warps=2, stages=2, splits=splits, cluster=cluster)
        assert (p.splits, p.slots, p.partials) == (splits + (splits >= 2), slots, partials), (splits, cluster)
        assert p.kernel == "mla_attention_p1_s2" + (f"_c{cluster}" if cluster > 1 else "") and p.threads == 64
    p = plan_attention(17, 8, 4096, **H200, **KIMI, warps=4, stages=3, cluster=8, loader=True)
    assert (p.kernel, p.threads, p.cluster, p.loader) == ("mla_attention_p2_s3_c8_ld", 160, 8, True)
    assert plan_attention(17, 8, 4096, **H200, **KIMI, loader=True).loader    # the fit among load-warp variants


def test_cluster_and_load_warp_knobs_are_refused_where_not_compiled():
    with pytest.raises(ValueError, match="cluster 4 not compiled for the decode form"):
        plan_attention(1, 8, 4096, **H200, **KIMI, cluster=4)
    with pytest.raises(ValueError, match="cluster 16 not compiled for the tree form"):
        plan_attention(17, 8, 4096, **H200, **KIMI, cluster=16)
    with pytest.raises(ValueError, match="no load-warp variant"):
        plan_attention(17, 8, 4096, **H200, **KIMI, form="tree", warps=8, stages=2, loader=True)


@pytest.mark.parametrize("arch", [H200, SM120], ids=["sm_90", "sm_120"])
def test_new_variants_fit_or_are_refused_by_shared_memory(arch):
    """Every cluster / load-warp variant at every preset's dims: a plan within the arch's opt-in shared memory
    (sm_120: 99 KB) or a refusal naming it. The cluster merge area overlays the query rows and key ring
    (the kernel's static_assert), so the clusters add no bytes; the empty barriers add 8 per stage."""
    from ddtree.model.presets import PRESETS, get_preset
    from ddtree.plugins.mla_attention import MLA_CLUSTERS, MLA_LOADER_VARIANTS, VARIANTS, smem_bytes
    for name in PRESETS:
        cfg = get_preset(name, layers=2 if name == "kimi-k2.6" else None)[0]
        dims = dict(latent=cfg.kv_lora_rank, rope=cfg.qk_rope_head_dim)
        for form, warps, stages, groups in VARIANTS:
            if form != "tree":
                continue
            for cluster, loader in itertools.product((1, *MLA_CLUSTERS), (False, True)):
                if loader and (warps, stages) not in MLA_LOADER_VARIANTS:
                    continue
                try:
                    p = plan_attention(17, 8, 4096, **arch, **dims, form="tree", warps=warps, stages=stages,
                                       cluster=cluster, loader=loader)
                except ValueError as exc:
                    assert smem_bytes(form, warps, stages, groups, **dims) > arch["smem_limit"]
                    assert "shared" in str(exc)
                    continue
                assert p.smem == smem_bytes(form, warps, stages, groups, **dims) <= arch["smem_limit"]
                merge_area = warps // 2 * 16 * (dims["latent"] + 5) * 4
                assert merge_area <= warps // 2 * 16 * (sum(dims.values()) + 8) * 2 + 2 * 32 * (sum(dims.values()) + 8) * 2
    # the 4 K x 17 plan of the sweep (2 warps, 2 stages) fits sm_120 with its clusters and load warp
    assert plan_attention(17, 8, 4096, **SM120, **KIMI, warps=2, stages=2, cluster=8, loader=True).smem <= 101376
