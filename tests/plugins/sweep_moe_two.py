"""H200 sweep of the MoE's two launches (moe_gate_up + moe_down) under plan knobs, uniform and tree routing (issue 22).

    python3 tests/plugins/sweep_moe_two.py TP MS [VARIANTS] [ROUTINGS]   # e.g. 8 9,17,33 -> JSON lines on stdout

Per routing (uniform; tree = bench step's tree routing at reuse 0.5: fewer distinct experts, more rows each) and M,
each variant of VARIANTS (comma-separated names of the table below; default all) is timed twice as `ddtree bench
moe` times the experts (16 routings a graph, median of 7 replays): the whole chain (route kernel + gate_up + down)
and its prefix route + gate_up, so that the down kernel's share is their difference.
"""
import json
import sys

import numpy as np

from ddtree.bench.kernels import (
    HIDDEN,
    _row,
    moe_operands,
    moe_plan_row,
    moe_routes,
    moe_touched_bytes,
    open_gpu,
    time_graph,
    time_moe,
)
from ddtree.plugins.moe import FusedMoE

R32 = (3, 2)
VARIANTS = {
    "default": {},                                              # the plan FusedMoE takes (measured knobs included)
    "s4": dict(gu_splits=4),
    "s7": dict(gu_splits=7),
    "s8": dict(gu_splits=8),
    "w8_s4": dict(gu_warps=8, gu_splits=4),
    "w8_s7": dict(gu_warps=8, gu_splits=7),
    "w8_s8": dict(gu_warps=8, gu_splits=8),
    "w8o3_s7": dict(gu_warps=8, gu_splits=7, gu_ring=R32, gu_occ=3),
    "w8o3_s8": dict(gu_warps=8, gu_splits=8, gu_ring=R32, gu_occ=3),
    "w8o3_s14": dict(gu_warps=8, gu_splits=14, gu_ring=R32, gu_occ=3),
    "w4o6_s14": dict(gu_warps=4, gu_splits=14, gu_ring=R32, gu_occ=6),
    "dn_o6": dict(dn_occ=6),
    "dn_w8o3": dict(dn_warps=8, dn_occ=3),
    "dn_tpw1": dict(dn_tpw=1),
    "dn_o6_tpw1": dict(dn_tpw=1, dn_occ=6),
    "dn_tpw4": dict(dn_tpw=4),
    "w8o3_s7_dn_o6": dict(gu_warps=8, gu_splits=7, gu_ring=R32, gu_occ=3, dn_occ=6),
    "w8_s4_dn_o6": dict(gu_warps=8, gu_splits=4, dn_occ=6),
    "heuristic": dict(gu_warps=16, gu_splits=2, dn_tpw=2),      # plan_moe's own plan at tp 8 (before moe_measured)
    "w8_s4_tpw4": dict(gu_warps=8, gu_splits=4, dn_tpw=4),
    "w8_s4_tpw3": dict(gu_warps=8, gu_splits=4, dn_tpw=3),
    "dn_tpw3": dict(dn_tpw=3),
    "w8_s8_tpw3": dict(gu_warps=8, gu_splits=8, dn_tpw=3),
    "w8_s2_tpw3": dict(gu_warps=8, gu_splits=2, dn_tpw=3),
    "w8_s4_tpw3_o6": dict(gu_warps=8, gu_splits=4, dn_tpw=3, dn_occ=6),
    "w8_s4_tpw3_w8o3": dict(gu_warps=8, gu_splits=4, dn_tpw=3, dn_warps=8, dn_occ=3),
    "w8_s8_tpw3_o6": dict(gu_warps=8, gu_splits=8, dn_tpw=3, dn_occ=6),
}


def main(tp: int, ms: list[int], names: list[str], routings: list[str], launches: int = 16, seed: int = 0) -> None:
    gpu, ceiling = open_gpu()
    shape, weights, x, out, expert_bytes = moe_operands(gpu, tp, max(ms), seed)
    moe = FusedMoE(gpu, shape, weights, streaming=False)
    for routing in routings:
        rng = np.random.default_rng(seed)
        for M in ms:
            routes, distinct = moe_routes(gpu, rng, M, launches, routing, 0.5)
            touched = moe_touched_bytes(float(np.mean(distinct)), expert_bytes, M, HIDDEN)
            for name in names:
                moe._overrides.pop(M, None)
                try:
                    if VARIANTS[name]:
                        moe.override(M, **VARIANTS[name])
                except ValueError as exc:
                    print(json.dumps({"tp": tp, "M": M, "routing": routing, "variant": name, "error": str(exc)}),
                          flush=True)
                    continue
                us = time_moe(gpu, moe, x, out, M, routes)

                def prefix(stream):
                    for ids, w in routes:
                        moe.launch_route(None, M, ids, w, stream)
                        moe.gate_up(x, M, stream)
                gu_us = time_graph(gpu, prefix) * 1e3 / launches
                row = _row({"tp": tp, "M": M, "routing": routing, "variant": name,
                            "distinct_experts": round(float(np.mean(distinct)), 1),
                            "route_gate_up_us": round(gu_us, 2), "plan": moe_plan_row(moe, M)},
                           touched, us, ceiling["gbps"])
                print(json.dumps(row), flush=True)
                print(f"  tp{tp} M={M:3d} {routing:7s} {name:16s} {us:8.2f} us (route+gate_up {gu_us:7.2f}) "
                      f"{row['pct_of_ceiling']:5.1f} %", file=sys.stderr)
            moe._overrides.pop(M, None)


if __name__ == "__main__":
    chosen = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else list(VARIANTS)
    routings = sys.argv[4].split(",") if len(sys.argv) > 4 else ["uniform", "tree"]
    main(int(sys.argv[1]), [int(m) for m in sys.argv[2].split(",")], chosen, routings)
