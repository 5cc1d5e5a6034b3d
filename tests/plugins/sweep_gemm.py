"""Every (warps, k-splits) plan of the skinny GEMM (plugins/gemm.py) timed per shape and row count, next to the
plan plan_gemm picks, so its cost model can be checked against the device (on the GPU machine):
    python3 tests/plugins/sweep_gemm.py [tp] [M,M,..] > sweep.json
Each candidate is a graph of launches over enough weight copies to defeat L2 (as ddtree bench gemm times).
Output: one JSON object {"device", "rows": [{"name", "N", "K", "M", "planned": {"warps", "splits", "us"},
"candidates": [{"warps", "splits", "blocks", "us"}, ...]}]}.
"""
import json
import sys

from ddtree.bench.kernels import GEMM_SHAPES, gemm_operands, time_gemm
from ddtree.plugins.device import Gpu
from ddtree.plugins.gemm import SkinnyGemm, _divisors


def sweep(gpu, tp: int, ms: list[int]) -> list[dict]:
    rows = []
    for name, N, K, residual in GEMM_SHAPES[tp]:
        operands = gemm_operands(gpu, N, K, max(ms), 0, 99)
        for M in ms:
            gemm = SkinnyGemm(gpu, N, K, max(ms))

            def timed():
                return time_gemm(gpu, gemm, operands, M, residual)
            p = gemm.plan(M)
            row = {"name": name, "N": N, "K": K, "M": M,
                   "planned": {"warps": p.warps, "splits": p.splits, "blocks": p.blocks, "us": round(timed(), 2)},
                   "candidates": []}
            for warps in (4, 8):
                for s in _divisors(K // 64):
                    try:
                        q = gemm.override(M, splits=s, warps=warps)
                    except ValueError:
                        continue
                    row["candidates"].append({"warps": warps, "splits": s, "blocks": q.blocks, "us": round(timed(), 2)})
            best = min(row["candidates"], key=lambda c: c["us"])
            print(f"{name:15s} M={M:3d} planned w{p.warps} s{p.splits:3d} {row['planned']['us']:7.1f} us; best "
                  f"w{best['warps']} s{best['splits']:3d} {best['us']:7.1f} us", file=sys.stderr)
            rows.append(row)
        gpu.free_all()
    return rows


if __name__ == "__main__":
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    ms = [int(m) for m in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 17, 33, 65]
    g = Gpu(0)
    print(json.dumps({"device": g.name, "tp": tp, "rows": sweep(g, tp, ms)}))
