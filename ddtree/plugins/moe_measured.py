"""The two launches' (moe_gate_up + moe_down) plan knobs where the H200 measured them faster than plan_moe's
heuristics under both bench routings (issue 22; the table below, and the notes of that session).

    knobs = two_launch_knobs(arch, shape, M)     # plan_moe keywords at M, {} where nothing was measured

Keyed by (arch, hidden, inter per rank) like moe_stream.STREAM_MEASURED: (first M, last M, knobs). The
batch-invariant plan ignores them (its gate_up split is max_tokens' at every M).
"""
from __future__ import annotations

# H200, Kimi tp 8 (7168, 256), one device call (tests/plugins/sweep_moe_two.py: route kernel + experts, 16
# routings a graph), us, plan_moe's plan -> 8-warp gate_up blocks (two an SM) at k-split 4, uniform top-8 / tree
# routing at reuse 0.5: M = 9 91.7-92.0 (the sweep's rows with this gate_up, route + gate_up 61.2-61.4; the plan's
# own row, first of its M, 99.7; `bench moe` in the next call 89.7) -> 86.3 (55.0) / 67.7 -> 62.2. A layer's 38-66
# tiles at k-split 2 are one wave of 16-warp blocks plus a few; 4x finer items shorten that tail.
# 2026-12-02 (NOTES "Three or four down tile pairs behind the 8-warp gate_up"): the same gate_up with 3 tile pairs
# a down warp (19 n-blocks of 24 tiles instead of 28 of 16), two calls, us uniform / tree: M = 9 86.1 / 64.7 ->
# 83.6 / 64.5, 12 122.8 / 73.9 -> 104.8 / 73.8, 17 137.9 / 98.7 -> 133.4 / 90.1 (plan_moe's own plan -> this),
# 25 190.5 / 126.6 -> 176.5 / 118.8; at 29 and 33 four tile pairs won under both routings (29: 204.3 / 137.4 ->
# 198.7 / 136.0, 33: 222.5 / 146.7 -> 217.0 / 146.1) where three lost at 29 under uniform (217.9).
# 2026-12-06 (eighth session, NOTES "One row's gate_up on 8-warp blocks"): H100, `bench moe --tp 8 --m 1 --no-router
# --paths cols --parts`, route kernel + experts (route + gate_up), us: plan_moe's 16 warps at k-split 14 (112 blocks)
# 23.55 (17.26); 8 warps at k-split 8 (two n-blocks: 128 blocks) 20.86 (14.37); 8 warps at 14 23.04, at 7 21.94;
# 16 warps at 8 24.09, at 7 25.34, at 4 30.55. In the step (ninth session, H100, bench step AR / budget 8 tree
# against git archive 51824de): no gain, within the spread (AR 5770 -> 5787 us); kept as neutral.
# 2026-12-07 (seventeenth session, NOTES "Nine rows' gate_up three blocks an SM"): M = 9, the budget 8 verify. H100,
# `bench moe --tp 8 --m 9 --routing tree --reuse 0.5 --no-router --paths cols --parts`, route kernel + experts (route
# + gate_up), us: 8 warps at k-split 4, two an SM (the 9..25 plan) 68.4 (47.0) -> three an SM on the 3x2 ring
# (OCC variant w8o3) at k-split 7 64.9 (43.4), 8 62.5 (41.1), 14 64.2 (42.6); the H200 sweep above had k-split 8
# 60.5 against 62.2 under tree. The step shows why: at budget 8 a layer's ~312 gate_up blocks are 264 resident (two
# an SM) and a second wave of ~48 that enter 27 us after the routing and stream alone to 45 us (H100 stamps). In the
# step (`bench step --context 4096 --budget 8 --routing tree --reuse 0.5 --accept 4 --ar --repeats 5 --baseline DIR
# --baseline-around`): budget 8 tree 0.5 9726 (the baseline's two runs 9741, 9711) -> 9661 us (1.007x), AR unchanged.
# 2026-12-07 (eighteenth session): withdrawn. Uniform routing, one H100 call: alone (same command, --routing uniform)
# 96.0 us against 94.6 for two an SM at k-split 4; in the step (`bench step --context 4096 --budget 8 --routing
# uniform,tree --reuse 0.5 --accept 4 --repeats 5 --baseline DIR --baseline-around`, DIR = the tree without it)
# budget 8 uniform 11712 / 11744 (the baseline's two runs) -> 11969 us (0.980x), tree 0.5 9851 / 9861 -> 9847
# (1.001x): the tree row's gain did not repeat and the uniform row (a target) lost 2 %. 9 rows take the 9..25 plan.
TWO_MEASURED = {("sm_90", 7168, 256): ((1, 1, dict(gu_warps=8, gu_splits=8)),
                                       (9, 25, dict(gu_warps=8, gu_splits=4, dn_tpw=3)),
                                       (26, 33, dict(gu_warps=8, gu_splits=4, dn_tpw=4)))}


def two_launch_knobs(arch: str, shape, M: int) -> dict:
    """plan_moe keywords measured faster at M on `arch` for `shape` (hidden, inter), else {}."""
    for first, last, knobs in TWO_MEASURED.get((arch.rstrip("a"), shape.hidden, shape.inter), ()):
        if first <= M <= last:
            return dict(knobs)
    return {}
