"""Where a tree_wgmma block's time goes (DD_PROFILE=2 build: block (0, 0)'s cycles per loop phase, and the
timelines of some splits of row tile 0), plus the L2-resident rate of the same plans.
python3 tests/plugins/profile_wgmma.py T q stages splits [...] (repo root, an sm_90 GPU)."""
import sys

from ddtree.bench.attention import bench_case
from ddtree.bench.kernels import open_gpu
from ddtree.plugins import mla_attention as ma

gpu, ceiling = open_gpu()
args = [int(a) for a in sys.argv[1:]]
plans = [args[i:i + 4] for i in range(0, len(args), 4)]
for T, q, stages, splits in plans:
    forced = dict(form="tree_wgmma", stages=stages, splits=splits)
    for l2 in (False, True):
        row = bench_case(gpu, T, q, 8, 8, ceiling["gbps"], forced, l2, True, True)
        print(f"T={T} q={q} s{stages} P{splits} {'L2' if l2 else 'HBM'}: {row['latency_us']:.2f} us, split "
              f"{row['split_us']} combine {row['combine_us']}", flush=True)
ma.WGMMA_DEFINES = {"MLA_TREE_WGMMA": 1, "DD_PROFILE": 2}
for T, q, stages, splits in plans:
    row = bench_case(gpu, T, q, 8, 1, ceiling["gbps"], dict(form="tree_wgmma", stages=stages, splits=splits),
                     False, False, True)
    gpu.sync()
    print(f"^ profiled T={T} q={q} s{stages} P{splits}", flush=True)
