"""H200 sweep of the streaming MoE launch against the two launches, same process, same routings (issue 22).

    python3 tests/plugins/sweep_moe_stream.py TP MS [VARIANTS]   # e.g. 8 1,17,65  -> JSON lines on stdout

Per M: the two launches (moe_gate_up + moe_down), then the streaming launch under each variant of VARIANTS
(comma-separated names of the table below; default all), each timed as `ddtree bench moe` times the experts
(route kernel + experts, 16 uniform top-8 routings in one graph, median of 7 replays).
"""
import json
import sys

import numpy as np

from ddtree.bench.kernels import (
    EXPERTS,
    HIDDEN,
    TOPK,
    _row,
    moe_operands,
    moe_plan_row,
    moe_touched_bytes,
    open_gpu,
    time_moe,
)
from ddtree.plugins.moe import FusedMoE

VARIANTS = {
    "default": {},
    "prefetch": dict(prefetch=12),
    "tpw1": dict(dn_tpw=1),
    "tpw2": dict(dn_tpw=2),
    "tpw7": dict(dn_tpw=7),
    "tpw14": dict(dn_tpw=14),
    "s14_tpw2": dict(gu_splits=14, dn_tpw=2),
    "s8_tpw1": dict(gu_splits=8, dn_tpw=1),
    "s8_tpw2": dict(gu_splits=8, dn_tpw=2),
    "s7_tpw2": dict(gu_splits=7, dn_tpw=2),
    "s4_tpw2": dict(gu_splits=4, dn_tpw=2),
    "s4_tpw7": dict(gu_splits=4, dn_tpw=7),
    "w8_s4_2bps": dict(gu_warps=8, gu_splits=4, blocks_per_sm=2),
    "w8_s4_2bps_tpw7": dict(gu_warps=8, gu_splits=4, blocks_per_sm=2, dn_tpw=7),
    "bulk": dict(bulk=True),
    "bulk_pin": dict(bulk=True, pin=True),
    "bulk_pin_s14": dict(bulk=True, pin=True, gu_splits=14, dn_tpw=1),
    "bulk_pin_r3": dict(bulk=True, pin=True, gu_ring=(3, 2), dn_tpw=1),
    "bulk_pin_w8_tpw2": dict(bulk=True, pin=True, gu_splits=14, gu_warps=8, dn_tpw=2),
    "r5_s14": dict(gu_ring=(5, 2), gu_splits=14),
    "bulk_r5_s14": dict(bulk=True, gu_ring=(5, 2), gu_splits=14),
    "bulk_s8_tpw2": dict(bulk=True, gu_splits=8, dn_tpw=2),
    "bulk_s4_tpw7": dict(bulk=True, gu_splits=4, dn_tpw=7),
    "bulk_w8_s4_2bps_tpw7": dict(bulk=True, gu_warps=8, gu_splits=4, blocks_per_sm=2, dn_tpw=7),
}


def main(tp: int, ms: list[int], names: list[str], launches: int = 16, seed: int = 0) -> None:
    gpu, ceiling = open_gpu()
    shape, weights, x, out, expert_bytes = moe_operands(gpu, tp, max(ms), seed)
    rng = np.random.default_rng(seed)
    for M in ms:
        routes, distinct = [], []
        for _ in range(launches):
            ids = np.stack([rng.permutation(EXPERTS)[:TOPK] for _ in range(M)]).astype(np.int32)
            routes.append((gpu.upload(ids), gpu.upload(np.full((M, TOPK), 2.827 / TOPK, np.float32))))
            distinct.append(len(np.unique(ids)))
        touched = moe_touched_bytes(float(np.mean(distinct)), expert_bytes, M, HIDDEN)
        runs = [("two-kernel", FusedMoE(gpu, shape, weights, streaming=False), None)]
        for name in names:
            moe = FusedMoE(gpu, shape, weights, streaming=True)
            try:
                moe.override_stream(M, **VARIANTS[name])
            except ValueError as exc:
                print(json.dumps({"tp": tp, "M": M, "variant": name, "error": str(exc)}), flush=True)
                continue
            runs.append((f"stream:{name}", moe, name))
        for label, moe, name in runs:
            us = time_moe(gpu, moe, x, out, M, routes)
            row = _row({"tp": tp, "M": M, "variant": label, "plan": moe_plan_row(moe, M)}, touched, us,
                       ceiling["gbps"])
            print(json.dumps(row), flush=True)
            print(f"  tp{tp} M={M:3d} {label:22s} {us:8.2f} us {row['pct_of_ceiling']:5.1f} %", file=sys.stderr)


if __name__ == "__main__":
    chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else list(VARIANTS)
    main(int(sys.argv[1]), [int(m) for m in sys.argv[2].split(",")], chosen)
