"""Fused-router plans (plugins/router.py: warps, weight tiles a block, k-splits) timed at Kimi's tp 8 router
(E 384, H 7168, top-8) per row count, beside the plan plan_router picks and the unfused path it replaced
(router GEMM + moe_route), so plan_router's cost model can be fitted to the device (on the GPU machine):
    python3 tests/plugins/sweep_router.py [M,M,..] [--few] > sweep.json
--few: only the planned knobs, folded or not, a folded plan's route_block (G > 1) or a warp a token, and an
unfolded plan's route phase with 0 (a warp a token from the logits), 32 or 16 lanes a row (route_rows).
Each launch of a graph reads its own copy of the weight, enough copies to defeat L2 (as each layer's router
in a step); `*_l2_us` repeat one copy (L2-warm, as `ddtree bench moe` times the router).
Each candidate's outputs are checked once, untimed: its ids and weights equal moe_route's on its own logits bit
for bit, and its logits are the planned plan's within fp32 accumulation (a split order of its own); a
candidate that fails is reported with "ok": false.
Output: one JSON object {"device", "rows": [{"M", "planned": {..., "us", "l2_us"}, "unfused_us",
"unfused_l2_us", "candidates": [{"warps", "tiles", "splits", "fold", "G", "lanes", "blocks", "us", "l2_us", "ok"},
...]}]}.
"""
import json
import sys

import numpy as np

from ddtree.bench.kernels import time_graph
from ddtree.plugins import randfill
from ddtree.plugins.device import Gpu
from ddtree.plugins.moe import FusedMoE, MoEShape

E, H, TOPK = 384, 7168, 8
WARPS, TILES, SPLITS = (4, 8, 16), (1, 2, 4, 8), (2, 4, 7, 8, 14, 16, 28, 56)


def knob_sets(planned, few: bool) -> list[dict]:
    if not few:
        return [dict(warps=w, tiles=t, splits=s) for w in WARPS for t in TILES for s in SPLITS]
    base = dict(warps=planned.warps, tiles=planned.tiles, splits=planned.splits)
    sets = [dict(base, fold=False), dict(base, fold=True)]
    if planned.fold and planned.route_warps > 1:
        sets.append(dict(base, fold=True, route_warps=1))
    if not planned.fold:
        sets += [dict(base, fold=False, lanes=lanes) for lanes in (0, 32, 16)]
    return sets


def sweep(gpu, ms: list[int], few: bool = False) -> list[dict]:
    copies = max(2, -(-4 * gpu.l2_bytes // (E * H * 2)))
    ws = [gpu.alloc((E // 16, H // 64, 4, 32, 8), np.uint16) for _ in range(copies)]
    for i, w in enumerate(ws):
        randfill.fill_device(gpu, w, 300 + i, randfill.WEIGHT_BF16)
    shape = MoEShape(H, 64, E, TOPK, scaling=2.827, max_tokens=max(ms))
    experts = {"gate_up": gpu.alloc((E, 4, H // 64, 2, 32, 4), np.int32),      # unused by route()
               "gate_up_scale": gpu.alloc((E, 4, H // 64, 2, 8, 4), np.uint16),
               "down": gpu.alloc((E, H // 32, 1, 2, 32, 4), np.int32),
               "down_scale": gpu.alloc((E, H // 32, 1, 2, 8, 4), np.uint16)}
    moe = FusedMoE(gpu, shape, experts, router=ws[0], bias=gpu.upload(np.zeros(E, np.float32)))
    x = gpu.alloc((max(ms), H), np.uint16)
    randfill.fill_device(gpu, x, 99, randfill.ACT_BF16)
    rows = []
    for M in ms:
        def fused(s, w):
            moe.router_fused.weight = w
            moe.route(x, M, stream=s)

        def unfused(s, w):
            moe.router, moe.fused_router = w, False
            moe.route(x, M, stream=s)
            moe.fused_router = True

        def timed(launch, n=copies):
            launch(gpu.stream, ws[0])
            gpu.sync()
            us = time_graph(gpu, lambda s: [launch(s, ws[i % n]) for i in range(copies)]) * 1e3 / copies
            return round(us, 2)

        def outputs():                    # one untimed launch on the first copy: logits, ids, weights
            fused(None, ws[0])
            gpu.sync()
            return moe.logits.numpy()[:M].copy(), moe.topk_ids.numpy()[:M].copy(), moe.topk_w.numpy()[:M].copy()

        def agrees(logits, ids, w, planned_logits) -> bool:
            moe.launch_route(moe.logits, M, ids_old, w_old, None)        # moe_route on the candidate's logits
            gpu.sync()
            return bool(np.array_equal(ids_old.numpy()[:M], ids) and np.array_equal(w_old.numpy()[:M], w)
                        and np.abs(logits - planned_logits).max() <= 1e-5 * np.abs(planned_logits).max())

        ids_old, w_old = gpu.alloc((M, TOPK), np.int32), gpu.alloc((M, TOPK), np.float32)
        planned_logits = outputs()[0]
        p = moe.router_fused.plan(M)
        row = {"M": M, "planned": {"warps": p.warps, "tiles": p.tiles, "splits": p.splits, "fold": p.fold,
                                   "G": p.route_warps, "lanes": p.lanes, "blocks": p.blocks, "us": timed(fused),
                                   "l2_us": timed(fused, 1)},
               "unfused_us": timed(unfused), "unfused_l2_us": timed(unfused, 1), "candidates": []}
        for knobs in knob_sets(p, few):
            try:
                q = moe.router_fused.override(M, **knobs)
            except ValueError:
                continue
            row["candidates"].append({"warps": q.warps, "tiles": q.tiles, "splits": q.splits, "fold": q.fold,
                                      "G": q.route_warps, "lanes": q.lanes, "blocks": q.blocks, "us": timed(fused),
                                      "l2_us": timed(fused, 1) if few else None,
                                      "ok": agrees(*outputs(), planned_logits)})
        moe.router_fused._overrides.pop(M, None)
        best = min([c for c in row["candidates"] if c["ok"]] or row["candidates"], key=lambda c: c["us"])
        failed = [(c["warps"], c["tiles"], c["splits"], c["fold"], c["G"], c["lanes"]) for c in row["candidates"]
                  if not c["ok"]]
        print(f"M={M:3d} planned w{p.warps} t{p.tiles} s{p.splits:3d} f{p.fold:d} G{p.route_warps} L{p.lanes} "
              f"{row['planned']['us']:6.2f} us (L2-warm {row['planned']['l2_us']:.2f}); best w{best['warps']} "
              f"t{best['tiles']} s{best['splits']:3d} f{best['fold']:d} G{best['G']} L{best['lanes']} "
              f"{best['us']:6.2f} us; "
              f"unfused {row['unfused_us']:.2f} us (L2-warm {row['unfused_l2_us']:.2f}); "
              f"{len(failed)} candidates failed the check {failed}",
              file=sys.stderr)
        rows.append(row)
    gpu.free_all()
    return rows


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--few"]
    ms = [int(m) for m in args[0].split(",")] if args else [1, 17, 65]
    g = Gpu(0)
    print(json.dumps({"device": g.name, "E": E, "H": H, "topk": TOPK,
                      "rows": sweep(g, ms, few="--few" in sys.argv[1:])}))
