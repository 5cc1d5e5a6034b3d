"""GPU tests of the skinny GEMM's measured plans (plugins/gemm_measured.py): at every table entry's shape and M the
default plan (the table's, on the cluster split-K where it qualifies and the sweep took it) against float64 numpy,
with the residual of the shapes that take one in the layer (o_proj, dense down), and SwiGLU for the dense and the
shared expert's gate_up as the layer runs them.
On a device the table does not name, the plan is the fitted one and the test says so (skip)."""
import numpy as np
import pytest
from test_gemm_tm_gpu import as_f64, gemm_case, run_plan
from test_kernels_gpu import assert_close

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.plugins import layout, randfill, reference
from ddtree.plugins.gemm_measured import GEMM_MEASURED

pytestmark = pytest.mark.gpu
RESIDUAL = {(7168, 1024), (7168, 2304)}
CASES = [(N, K, M) for (N, K), by_m in GEMM_MEASURED[("sm_90", 132)].items() for M in sorted(by_m)]


def _on_the_swept_device(gpu):
    if (gpu.arch.rstrip("a"), gpu.sm_count) not in GEMM_MEASURED:
        pytest.skip(f"no measured GEMM plans for {gpu.arch} with {gpu.sm_count} SMs")


@pytest.mark.parametrize("N,K,M", CASES, ids=lambda v: str(v))
def test_measured_plan_against_numpy(gpu, N, K, M):
    _on_the_swept_device(gpu)
    c = gemm_case(gpu, f"{N}x{K}", (N, K, (N, K) in RESIDUAL, N == 384), 900 + M, M)
    p, y = run_plan(gpu, c, M)
    knobs = GEMM_MEASURED[("sm_90", 132)][(N, K)][M]
    assert (p.warps, p.tpw, p.splits) == knobs[1:4], p
    assert not p.dsmem or (knobs[4] if len(knobs) > 4 else True), p     # a fifth field False: the global path
    assert_close(as_f64(c, y), c["ref"][:M], atol_rms=2e-3, what=f"gemm measured {N}x{K} {p} M={M}")
    gpu.free_all()


SWIGLU = [(N, M) for N in (4608, 512) for M in sorted(GEMM_MEASURED[("sm_90", 132)].get((N, 7168), {}))]


@pytest.mark.parametrize("N,M", SWIGLU, ids=lambda v: str(v))
def test_measured_swiglu_against_numpy_and_the_global_split(gpu, N, M):
    """Dense gate_up (4608) and the shared expert's (512) with SwiGLU in the epilogue, as the layer runs them: the
    measured plan's silu(gate) * up against float64 numpy, and bitwise a global-path launch of the same knobs (the
    same sums in the same order)."""
    from ddtree.plugins.gemm import SkinnyGemm
    _on_the_swept_device(gpu)
    K = 7168
    gate_up = randfill.hash_array((N, K), np.uint16, 41, randfill.WEIGHT_BF16)
    x = randfill.hash_array((M, K), np.uint16, 42, randfill.ACT_BF16)
    wd = gpu.upload(layout.tile_bf16(layout.fuse_gate_up(gate_up[: N // 2], gate_up[N // 2:])))
    xd, out = gpu.upload(x), gpu.alloc((M, N // 2), np.uint16)
    gemm = SkinnyGemm(gpu, N, K, M)
    p = gemm.plan(M)
    gemm.run(xd, wd, out, M, swiglu=True)
    gpu.sync()
    y = out.numpy().copy()
    gemm.override(M, warps=p.warps, tpw=p.tpw, splits=p.splits, dsmem=False)
    gemm.run(xd, wd, out, M, swiglu=True)
    gpu.sync()
    assert np.array_equal(y, out.numpy()), f"gate_up {N} swiglu M={M}: cluster vs global split {p}"
    gate = reference.gemm(x, gate_up[: N // 2]).astype(np.float32)   # each rounded to bf16 before silu * up
    up = reference.gemm(x, gate_up[N // 2:]).astype(np.float32)
    ref = reference.silu_mul(np.concatenate([f32_to_bf16(gate), f32_to_bf16(up)], axis=1))
    # a gate or up sum whose fp32 and float64 roundings to bf16 part ways moves the product by one bf16 ulp (2^-8)
    got, rms = bf16_to_f32(y).astype(np.float64), np.sqrt(np.mean(ref ** 2))
    err = np.abs(got - ref) - (2.0 ** -6 * np.abs(ref) + 2e-3 * rms)
    worst = np.unravel_index(err.argmax(), got.shape)
    assert np.isfinite(got).all() and err.max() <= 0, \
        f"gate_up {N} swiglu M={M} {p}: element {worst} off by {np.abs(got - ref)[worst]:.3e}"
    assert np.linalg.norm(got - ref) <= 3e-3 * np.linalg.norm(ref), f"gate_up {N} swiglu M={M} {p}: relative error"
    gpu.free_all()
