"""tree_wgmma with its copies 8 rows x 4 chunks (default) and 4 x 8 a warp step (-D WG_LOAD_ROWS), same plans, and
each profiled (DD_PROFILE=2: block (0, 0)'s cycles per loop phase). python3 tests/plugins/profile_wgmma_loads.py"""
import sys

from ddtree.bench.attention import bench_case
from ddtree.bench.kernels import open_gpu
from ddtree.plugins import mla_attention as ma

gpu, ceiling = open_gpu()
plans = ((4096, 17, 2, 22), (4096, 17, 2, 43), (32768, 17, 2, 43), (32768, 8, 2, 86))
for rows in (8, 4):
    for prof in (0, 2):
        ma.WGMMA_DEFINES = {"MLA_TREE_WGMMA": 1, "WG_LOAD_ROWS": rows, **({"DD_PROFILE": 2} if prof else {})}
        for T, q, stages, splits in plans:
            row = bench_case(gpu, T, q, 8, 8 if not prof else 1, ceiling["gbps"],
                             dict(form="tree_wgmma", stages=stages, splits=splits), False, not prof, True)
            gpu.sync()
            if not prof:
                print(f"rows {rows}: T={T} q={q} s{stages} P{splits}: {row['latency_us']:.2f} us, split {row['split_us']} "
                      f"combine {row['combine_us']}", flush=True)
            else:
                print(f"^ profiled rows {rows} T={T} q={q}", flush=True)
            sys.stdout.flush()
