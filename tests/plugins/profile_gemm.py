"""One launch per skinny GEMM plan, for Nsight Compute (kernel-level stall sampling; no graphs, no timing):
    ncu --kernel-name regex:gemm_bf16 --section WarpStateStats ... python3 tests/plugins/profile_gemm.py \
        lm_head:65 lm_head:65:tpw=4,warps=4,max_mt=9
Each argument is NAME:M[:knob=value,...], NAME a tp 8 shape of ddtree.bench.kernels.GEMM_SHAPES, the knobs those of
SkinnyGemm.override (splits, tpw, warps, max_mt); the plan of each launch is printed to stderr.
"""
import sys

import numpy as np

from ddtree.bench.kernels import GEMM_SHAPES
from ddtree.plugins import randfill
from ddtree.plugins.device import Gpu
from ddtree.plugins.gemm import SkinnyGemm


def launch(gpu, spec: str) -> None:
    name, m, *knobs = spec.split(":")
    M = int(m)
    shapes = {n: (N, K, r) for n, N, K, r in GEMM_SHAPES[8]}
    if name not in shapes:
        raise SystemExit(f"profile_gemm: unknown shape {name!r}; known {sorted(shapes)}")
    N, K, residual = shapes[name]
    w = gpu.alloc((-(-N // 16), K // 64, 4, 32, 8), np.uint16)
    randfill.fill_device(gpu, w, 1, randfill.WEIGHT_BF16)
    x = gpu.alloc((M, K), np.uint16)
    randfill.fill_device(gpu, x, 2, randfill.ACT_BF16)
    out = gpu.zeros((M, N), np.uint16)
    gemm = SkinnyGemm(gpu, N, K, M)
    if knobs:
        gemm.override(M, **{k: int(v) for k, v in (kv.split("=") for kv in knobs[0].split(",") if kv)})
    gemm.run(x, w, out, M, residual=out if residual else None)
    gpu.sync()
    print(f"{spec}: {gemm.plan(M)}", file=sys.stderr)
    gpu.free_all()


if __name__ == "__main__":
    g = Gpu(0)
    for arg in sys.argv[1:]:
        launch(g, arg)
