"""The MoE's two launches at one M for ncu (issue 22): route + gate_up + down, eagerly, `runs` times.

    python3 tests/plugins/profile_moe.py TP M [ROUTING] [RUNS] [KNOBS-JSON]    # e.g. 8 17 uniform 3
    ncu --section SourceCounters --section WarpStateStats -k regex:moe_gate_up --launch-skip 2 -c 1 \\
        -o rep python3 tests/plugins/profile_moe.py 8 17

Weights random (ddtree.plugins.randfill), ids as `ddtree bench moe --routing ROUTING` makes them (seed 0).
KNOBS-JSON: plan_moe knobs forced at M (FusedMoE.override), e.g. '{"gu_warps": 8, "gu_splits": 4}'.
"""
import json
import sys

import numpy as np

from ddtree.bench.kernels import EXPERTS, HIDDEN, TOPK, TP_SHAPES, moe_routing_ids, moe_weight_shapes
from ddtree.plugins import randfill
from ddtree.plugins.device import Gpu
from ddtree.plugins.moe import FusedMoE, MoEShape


def main(tp: int, M: int, routing: str = "uniform", runs: int = 3, knobs: dict | None = None) -> None:
    gpu = Gpu()
    I = TP_SHAPES[tp]["inter"]
    shape = MoEShape(HIDDEN, I, EXPERTS, TOPK, scaling=2.827, max_tokens=M)
    weights = {k: gpu.alloc(s, dt) for k, (s, dt) in moe_weight_shapes(EXPERTS, HIDDEN, I).items()}
    for i, (key, arr) in enumerate(weights.items()):
        randfill.fill_device(gpu, arr, i, randfill.SCALES_BF16 if "scale" in key else randfill.INT4_WORDS)
    x = gpu.alloc((M, HIDDEN), np.uint16)
    randfill.fill_device(gpu, x, 8, randfill.ACT_BF16)
    out = gpu.alloc((M, HIDDEN), np.uint16)
    moe = FusedMoE(gpu, shape, weights, streaming=False)
    if knobs:
        moe.override(M, **knobs)
    ids = moe_routing_ids(np.random.default_rng(0), M, routing, 0.5)
    route = (gpu.upload(ids), gpu.upload(np.full((M, TOPK), 2.827 / TOPK, np.float32)))
    p = moe.plan(M)
    print(f"tp {tp} M {M} {routing}: {len(np.unique(ids))} experts; {p.gate_up_kernel} grid ({p.gu_nb}, "
          f"{p.gu_splits}, {p.tiles}) x {p.gu_warps} warps, {p.down_kernel} grid ({p.dn_nb}, {p.dn_splits}, "
          f"{p.tiles}) x {p.dn_warps} warps", file=sys.stderr)
    for _ in range(runs):
        moe.run(x, out, M, topk=route)
    gpu.sync()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), a[2] if len(a) > 2 else "uniform", int(a[3]) if len(a) > 3 else 3,
         json.loads(a[4]) if len(a) > 4 else None)
