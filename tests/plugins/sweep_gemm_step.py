"""The rank step's skinny GEMMs at the step's own small row counts (issue 48): Kimi tp 8's shapes as the step runs
them (q_a | kv_a as one GEMM, the shared expert's gate_up with its SwiGLU epilogue, the drafter's GEMMs at its block
of 8 rows), at AR's 1 row, the drafter's 8, budget 8's verify of 9 and budget 16's of 17, every (warps, tpw,
k-split) plan and, at k-splits 2..8, the same plan with its split-K summed through a cluster's shared memory
(gemm.with_dsmem; the plans of <= 16 rows were only ever swept on the global path). On the GPU machine:
    python3 tests/plugins/sweep_gemm_step.py [NAME,NAME,..|all] [M,M,..] > sweep.json
Each candidate is a graph of launches over enough weight copies to defeat L2 (as ddtree bench gemm times), timed
twice (the lower kept). Output: one JSON object {"device", "sm_count", "rows": [{"name", "N", "K", "M", "planned",
"candidates": [...]}]}, each plan as {"warps", "tpw", "splits", "dsmem", "mt", "mb", "blocks", "kernel", "us"}.
"""
import json
import sys

from ddtree.bench.kernels import gemm_operands, time_gemm
from ddtree.plugins.device import Gpu
from ddtree.plugins.gemm import DSMEM_SPLITS, SkinnyGemm, _divisors

# (name, N, K, residual, swiglu, row counts): the step's GEMMs at tp 8 (grids in the H200 step file's top_kernels)
STEP_SHAPES = [("q_a_kv_a", 2112, 7168, False, False, (1, 9, 17)),
               ("q_b", 1536, 1536, False, False, (1, 9, 17)),
               ("o_proj", 7168, 1024, True, False, (1, 8, 9, 17)),
               ("shared_gate_up", 512, 7168, False, True, (1, 9, 17)),
               ("shared_down", 7168, 256, True, False, (1, 9, 17)),
               ("draft_qkv", 1280, 7168, False, False, (8,)),
               ("draft_gate_up", 4608, 7168, False, True, (8,)),
               ("draft_down", 7168, 2304, True, False, (8,)),
               ("lm_head", 20480, 7168, False, False, (1, 8, 9, 17))]


def _plan_row(p, us: float) -> dict:
    return {"warps": p.warps, "tpw": p.tpw, "splits": p.splits, "dsmem": p.dsmem, "mt": p.mt, "mb": p.mb,
            "blocks": p.blocks, "kernel": p.kernel, "us": round(us, 2)}


def sweep(gpu, names: set | None, only_ms: set | None = None) -> list[dict]:
    rows = []
    for name, N, K, residual, swiglu, ms in STEP_SHAPES:
        ms = tuple(m for m in ms if not only_ms or m in only_ms)
        if (names and name not in names) or not ms:
            continue
        operands = gemm_operands(gpu, N, K, max(ms), 0, 99)
        gemm = SkinnyGemm(gpu, N, K, max(ms))
        for M in ms:
            def timed():
                return min(time_gemm(gpu, gemm, operands, M, residual, swiglu) for _ in range(2))
            gemm._overrides.clear()
            row = {"name": name, "N": N, "K": K, "M": M, "planned": _plan_row(gemm.plan(M), timed()),
                   "candidates": []}
            seen = set()
            for warps in (4, 8):
                for tpw in (1, 2):
                    for s in _divisors(K // 64):
                        for dsmem in (False, True):
                            if dsmem and not DSMEM_SPLITS[0] <= s <= DSMEM_SPLITS[1]:
                                continue
                            try:
                                p = gemm.override(M, splits=s, tpw=tpw, warps=warps, dsmem=dsmem)
                            except ValueError:
                                continue
                            key = (p.warps, p.tpw, p.splits, p.dsmem, p.mt, p.mb)
                            if key in seen:
                                continue
                            seen.add(key)
                            row["candidates"].append(_plan_row(p, timed()))
            gemm._overrides.clear()
            best = min(row["candidates"], key=lambda c: c["us"])
            pl = row["planned"]
            print(f"{name:15s} M={M:2d} planned w{pl['warps']} t{pl['tpw']} s{pl['splits']:3d} d{int(pl['dsmem'])} "
                  f"{pl['us']:7.2f} us; best w{best['warps']} t{best['tpw']} s{best['splits']:3d} "
                  f"d{int(best['dsmem'])} {best['us']:7.2f} us", file=sys.stderr)
            rows.append(row)
        gpu.free_all()
    return rows


if __name__ == "__main__":
    names = set(sys.argv[1].split(",")) if len(sys.argv) > 1 and sys.argv[1] != "all" else None
    only_ms = {int(m) for m in sys.argv[2].split(",")} if len(sys.argv) > 2 else None
    g = Gpu(0)
    print(json.dumps({"device": g.name, "sm_count": g.sm_count, "rows": sweep(g, names, only_ms)}))
