"""The skinny GEMM's tile knobs past 16 rows (issue 22): per shape and row count, the plan plan_gemm picks next to
every (max_mt, tpw, warps) combination, each at the k-split the fitted cost picks for it and, for weights of
>= 14 MB, at the divisors of K / 64 on either side of it. max_mt 9 puts 65..72 rows in one token block (the weights
streamed once), tpw 4 is the four-tile group kernel (gemm_bf16_mt<MT>_g4), max_mt "tm" the tokens-as-M kernels
(gemm_bf16_tm<TT>_g<tpw>). On the GPU machine:
    python3 tests/plugins/sweep_gemm_tiles.py [tp] [M,M,..] > sweep.json
Each candidate is a graph of launches over enough weight copies to defeat L2 (as ddtree bench gemm times).
Output: one JSON object {"device", "tp", "rows": [{"name", "N", "K", "M", "planned": {...}, "candidates": [...]}]},
each plan as {"max_mt", "mt", "mb", "tpw", "warps", "splits", "blocks", "kernel", "us"}.
"""
import json
import sys

from ddtree.bench.kernels import GEMM_SHAPES, gemm_operands, time_gemm
from ddtree.plugins.device import Gpu
from ddtree.plugins.gemm import SkinnyGemm, _divisors

COMBOS = [(max_mt, tpw, warps) for max_mt in (8, 9) for tpw in (1, 2, 4) for warps in (4, 8)
          if not (tpw == 4 and warps == 8)]      # 8 warps x 4 tiles leave no room for the token rows
COMBOS += [("tm", tpw, warps) for tpw in (1, 2) for warps in (4, 8)]   # tokens as the mma's M side (gemm_tm.cuh)


def _plan_row(p, us: float, max_mt: int | None) -> dict:
    return {"max_mt": max_mt, "mt": p.mt, "mb": p.mb, "tpw": p.tpw, "warps": p.warps, "splits": p.splits,
            "blocks": p.blocks, "kernel": p.kernel, "us": round(us, 2)}


def _neighbours(kc: int, s: int) -> list[int]:
    divs = _divisors(kc)
    i = divs.index(s)
    return [d for d in divs[max(0, i - 1):i + 2] if d != s]


def sweep(gpu, tp: int, ms: list[int]) -> list[dict]:
    rows = []
    for name, N, K, residual in GEMM_SHAPES[tp]:
        wbytes = N * K * 2
        operands = gemm_operands(gpu, N, K, max(ms), 0, 99)
        for M in ms:
            gemm = SkinnyGemm(gpu, N, K, max(ms))

            def timed():
                return time_gemm(gpu, gemm, operands, M, residual)
            row = {"name": name, "N": N, "K": K, "M": M, "planned": _plan_row(gemm.plan(M), timed(), None),
                   "candidates": []}
            seen = set()
            for max_mt, tpw, warps in COMBOS:
                if max_mt == 9 and -(-M // 8) <= 8:          # the same token tiles as max_mt 8
                    continue
                form = dict(tm=True) if max_mt == "tm" else dict(tm=False, max_mt=max_mt)
                try:
                    auto = gemm.override(M, tpw=tpw, warps=warps, **form).splits
                except ValueError:
                    continue
                splits = [auto] + (_neighbours(K // 64, auto) if wbytes >= 14e6 else [])
                for s in splits:
                    try:
                        p = gemm.override(M, splits=s, tpw=tpw, warps=warps, **form)
                    except ValueError:
                        continue
                    key = (p.tm, p.mt, p.mb, p.tpw, p.warps, p.splits)
                    if key in seen:
                        continue
                    seen.add(key)
                    row["candidates"].append(_plan_row(p, timed(), max_mt))
            gemm._overrides.clear()
            best = min(row["candidates"], key=lambda c: c["us"])
            pl = row["planned"]
            print(f"{name:15s} M={M:3d} planned {pl['kernel']} w{pl['warps']} t{pl['tpw']} s{pl['splits']:3d} "
                  f"{pl['us']:7.1f} us; best {best['kernel']} w{best['warps']} t{best['tpw']} s{best['splits']:3d} "
                  f"{best['us']:7.1f} us", file=sys.stderr)
            rows.append(row)
        gpu.free_all()
    return rows


if __name__ == "__main__":
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    ms = [int(m) for m in sys.argv[2].split(",")] if len(sys.argv) > 2 else [17, 33, 65]
    g = Gpu(0)
    print(json.dumps({"device": g.name, "tp": tp, "rows": sweep(g, tp, ms)}))
