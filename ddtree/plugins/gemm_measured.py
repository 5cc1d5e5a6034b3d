"""The skinny GEMM's plans where a sweep measured them faster than plan_gemm's: past 16 rows against its fitted cost
on an H200 (issue 22; ddtree/plugins/kernels/NOTES.md, "Measured GEMM plans past 16 rows"), and at the rank step's
1 / 8 / 9 rows against its waves model and its 17 against the fitted cost on an H100 (issue 48, the twelfth and
nineteenth sessions' sections there).

    knobs = measured_gemm_knobs(arch, sm_count, N, K, M)   # plan_gemm's forced knobs at exactly M, or None

Keyed like moe_measured.TWO_MEASURED by the device (arch, SM count: the sweep's grid fills are per SM) and the
weight shape; a row holds only the M it was swept at (the verify's rows at budgets 8 / 16 / 32 / 64, AR's one row,
the drafter's block of 8), never a range it was not. Each entry is (max_mt, warps, tpw, splits[, dsmem]) of the
sweep's fastest 8-row-kernel candidate, launched as the sweep ran it: split-K through a cluster's shared memory
wherever the plan qualifies (gemm.with_dsmem), unless its fifth field says False (the global path won). Adopted
where it beat the planned choice by >= 5 % in that sweep and was not slower than the fitted plan (global-path
split-K) in the A/B of `bench gemm` that followed (tests/fixtures/plugins/gemm_ab_h200_tp8_measured.json); the
batch-invariant plan ignores the table (its split is max_tokens').
"""
from __future__ import annotations

# H200 (132 SMs), Kimi tp 8's GEMMs, tests/plugins/sweep_gemm_tiles.py 8 17,33,65 (the fixture
# tests/fixtures/plugins/gemm_sweep_h200_tp8_dsmem_tm.json, every candidate at S 2..8 and tpw <= 2 on the cluster
# split-K), us the sweep's planned -> this plan:
#   q_a 65 30.8 -> 21.0, q_b 65 10.0 -> 9.4, kv_b 17 / 33 / 65 4.6 / 6.3 / 6.8 -> 4.1 / 5.7 / 6.2,
#   o_proj 33 / 65 14.9 / 22.2 -> 12.6 / 18.3, dense gate_up 17 / 33 / 65 33.5 / 45.7 / 79.2 -> 30.0 / 40.4 / 62.1,
#   dense down 33 / 65 32.2 / 46.6 -> 18.3 / 24.9, router 65 13.9 -> 12.1, lm_head 65 237.1 -> 192.2.
# The A/B in one later call (`ddtree bench gemm --tp 8 --m 17,33,65`, fitted plans -> this table), us: q_a 65
# 27.3 -> 20.9, q_b 65 11.3 -> 9.2, kv_b 17 / 33 / 65 4.6 / 6.3 / 6.8 -> 4.1 / 5.7 / 6.2, o_proj 33 / 65 14.9 / 22.2
# -> 12.5 / 18.3, dense gate_up 17 / 65 33.1 / 62.8 -> 30.2 / 61.9, dense down 33 / 65 28.3 / 41.2 -> 18.2 / 25.1,
# router 65 15.7 -> 12.2, lm_head 65 193.5 -> 191.6; dense gate_up 33 lost (39.8 -> 40.3: the fitted global-path
# plan was already there) and is not in the table.
#
# The step's own small row counts (issue 48, 2026-12-07 twelfth session): AR's 1 row, the drafter's block of 8 and
# budget 8's verify of 9, the shapes as the step runs them (q_a | kv_a as one [2112, 7168] GEMM, the shared expert's
# gate_up with SwiGLU, the drafter's q | k | v [1280, 7168], gate_up, down and o_proj), every (warps, tpw, k-split)
# plan on the global path and, at k-splits 2..8, on the cluster split-K (tests/plugins/sweep_gemm_step.py; the
# fixture tests/fixtures/plugins/gemm_sweep_h100_tp8_step_rows.json, one H100 SXM: 132 SMs, sm_90 like the H200).
# Rows whose best beat the planned choice (the waves model) by >= 5 %, us planned -> this plan: q_a | kv_a 1 14.27
# -> 13.10, q_b 1 4.76 -> 4.21, o_proj 1 / 8 / 9 8.82 / 9.89 / 11.46 -> 8.14 / 8.85 / 9.49, shared gate_up 1 / 9
# 6.16 / 7.40 -> 5.07 / 6.72, drafter q | k | v 8 10.98 -> 9.96, dense gate_up 8 29.93 -> 26.74, dense down 8
# 19.79 -> 16.39, lm_head 1 / 8 108.4 / 111.0 -> 102.8 / 104.2. The cluster split-K won none of them (a fifth
# field False: launched on the global path, as swept); q_a | kv_a and lm_head at 9 rows, q_b at 9 and the shared
# expert's down stay planned (within 5 %). The step A/B on the H100 (`bench step --baseline`, NOTES): budget 8 tree
# 0.5 -2.2 %, but AR +0.5 % with the one-row rows (their ramps already overlapped their predecessors under PDL),
# so the one-row rows are not in the table (STEP_AB_NOT_FASTER).
# Budget 16's verify of 17 rows (2026-12-07 nineteenth session, the same sweep at 17: the fixture
# tests/fixtures/plugins/gemm_sweep_h100_tp8_step_rows17.json, one H100 SXM; it supersedes the H200 sweep's 17-row
# rows of these shapes), us planned -> this plan: q_a | kv_a 19.90 -> 17.16, q_b 7.08 -> 5.99 (the cluster split-K),
# shared gate_up 8.37 -> 7.92, lm_head 121.20 -> 115.08; o_proj and the shared down stay planned. The step A/B on
# the H100 (`bench step --budget 16 --baseline-around`, NOTES): uniform 16192 -> 16014 us, tree 0.5 12843 -> 12688.
STEP_AB_NOT_FASTER = (1,)
GEMM_MEASURED = {
    ("sm_90", 132): {
        (1536, 7168): {65: (8, 8, 2, 8)},
        (1536, 1536): {17: (8, 4, 1, 6, True), 65: (8, 4, 2, 4)},
        (2048, 512): {17: (8, 4, 1, 1), 33: (8, 4, 1, 1), 65: (8, 4, 1, 1)},
        (7168, 1024): {8: (8, 8, 1, 1, False), 9: (8, 8, 1, 1, False), 33: (8, 8, 2, 4), 65: (9, 8, 2, 4)},
        (4608, 7168): {8: (8, 8, 1, 7, False), 17: (8, 8, 2, 4), 65: (8, 8, 2, 8)},
        (7168, 2304): {8: (8, 8, 1, 4, False), 33: (8, 8, 2, 4), 65: (9, 8, 2, 4)},
        (384, 7168): {65: (8, 4, 1, 8)},
        (20480, 7168): {8: (8, 8, 1, 16, False), 17: (8, 8, 1, 4, False), 65: (9, 8, 2, 16)},
        (512, 7168): {9: (8, 4, 1, 16, False), 17: (8, 4, 1, 16, False)},
        (2112, 7168): {17: (8, 8, 1, 7, False)},
        (1280, 7168): {8: (8, 4, 1, 16, False)},
    },
}


def measured_gemm_knobs(arch: str, sm_count: int, N: int, K: int, M: int) -> dict | None:
    """plan_gemm's forced keywords (max_mt, warps, tpw, splits) measured at exactly M rows on this device for the
    weight [N, K], and dsmem (the cluster split-K where the plan qualifies: a row's fifth field, True when absent),
    else None."""
    row = GEMM_MEASURED.get((arch.rstrip("a"), sm_count), {}).get((N, K), {}).get(M)
    if row is None:
        return None
    max_mt, warps, tpw, splits, *dsmem = row
    return dict(max_mt=max_mt, warps=warps, tpw=tpw, splits=splits, dsmem=dsmem[0] if dsmem else True)
