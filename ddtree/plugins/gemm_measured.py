"""The skinny GEMM's plans past 16 rows where an H200 sweep measured them faster than plan_gemm's fitted cost (issue
22; ddtree/plugins/kernels/NOTES.md, "Measured GEMM plans past 16 rows").

    knobs = measured_gemm_knobs(arch, sm_count, N, K, M)   # plan_gemm's forced knobs at exactly M, or None

Keyed like moe_measured.TWO_MEASURED by the device (arch, SM count: the sweep's grid fills are per SM) and the
weight shape; a row holds only the M it was swept at (the verify's rows at budgets 16 / 32 / 64), never a range it
was not. Each entry is (max_mt, warps, tpw, splits) of the sweep's fastest 8-row-kernel candidate, launched as the
sweep ran it: split-K through a cluster's shared memory wherever the plan qualifies (gemm.with_dsmem). Adopted
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
GEMM_MEASURED = {
    ("sm_90", 132): {
        (1536, 7168): {65: (8, 8, 2, 8)},
        (1536, 1536): {65: (8, 4, 2, 4)},
        (2048, 512): {17: (8, 4, 1, 1), 33: (8, 4, 1, 1), 65: (8, 4, 1, 1)},
        (7168, 1024): {33: (8, 8, 2, 4), 65: (9, 8, 2, 4)},
        (4608, 7168): {17: (8, 8, 2, 4), 65: (8, 8, 2, 8)},
        (7168, 2304): {33: (8, 8, 2, 4), 65: (9, 8, 2, 4)},
        (384, 7168): {65: (8, 4, 1, 8)},
        (20480, 7168): {65: (9, 8, 2, 16)},
    },
}


def measured_gemm_knobs(arch: str, sm_count: int, N: int, K: int, M: int) -> dict | None:
    """plan_gemm's forced keywords (max_mt, warps, tpw, splits) measured at exactly M rows on this device for the
    weight [N, K], else None."""
    row = GEMM_MEASURED.get((arch.rstrip("a"), sm_count), {}).get((N, K), {}).get(M)
    if row is None:
        return None
    max_mt, warps, tpw, splits = row
    return dict(max_mt=max_mt, warps=warps, tpw=tpw, splits=splits)
