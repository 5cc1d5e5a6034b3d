"""GPU tests of the skinny GEMM's split-K through a cluster's distributed shared memory (gemm.cu dsmem): bitwise the
global-memory path's outputs (the same partials summed in the same order) under forced splits 2..8, one and two
tiles a warp, 1..65 rows, the residual, fp32 out, ragged N and the SwiGLU epilogue; and against float64 numpy."""
import numpy as np
import pytest
from test_gemm_tm_gpu import as_f64, gemm_case, run_plan
from test_kernels_gpu import assert_close

from ddtree.plugins import layout, randfill

pytestmark = pytest.mark.gpu
# name: (N, K, residual, out_f32)
SHAPES = {"q_a": (1536, 7168, False, False), "dense_down_res": (7168, 2304, True, False),
          "router_f32": (384, 7168, False, True), "ragged_n": (200, 512, True, False)}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def case(gpu, request):
    seed = 800 + 10 * sorted(SHAPES).index(request.param)
    return gemm_case(gpu, request.param, SHAPES[request.param], seed, 65, dsmem=True)


@pytest.mark.parametrize("tpw", [1, 2])
@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("M", [1, 9, 17, 65])
def test_dsmem_split_k_is_the_global_path_bitwise(gpu, case, M, splits, tpw):
    c, outs = case, []
    if (c["K"] // 64) % splits:
        pytest.skip(f"splits {splits} do not divide K / 64 = {c['K'] // 64}")
    for dsmem in (True, False):
        try:
            p, y = run_plan(gpu, c, M, splits=splits, tpw=tpw, warps=8, dsmem=dsmem)
        except ValueError as exc:                                  # the token rows of few splits can exceed smem
            assert "shared memory" in str(exc), exc
            pytest.skip(str(exc))
        assert p.dsmem == dsmem and p.splits == splits, p
        outs.append(y)
    assert_close(as_f64(c, outs[0]), c["ref"][:M], atol_rms=2e-3, what=f"gemm dsmem {c['name']} M={M} S={splits}")
    assert np.array_equal(outs[0].view(np.uint8), outs[1].view(np.uint8)), f"{c['name']} M={M}: dsmem != global"


@pytest.mark.parametrize("M", [1, 17])
def test_dsmem_swiglu_is_the_global_path_bitwise(gpu, M):
    from ddtree.plugins.gemm import SkinnyGemm
    I, K = 2304, 7168
    w = randfill.hash_array((2 * I, K), np.uint16, 851, randfill.WEIGHT_BF16)
    x = gpu.upload(randfill.hash_array((M, K), np.uint16, 852, randfill.ACT_BF16))
    wd = gpu.upload(layout.tile_bf16(layout.fuse_gate_up(w[:I], w[I:])))
    gemm, outs = SkinnyGemm(gpu, 2 * I, K, 17, dsmem=True), []
    for dsmem in (True, False):
        assert gemm.override(M, splits=4, warps=8, dsmem=dsmem).dsmem == dsmem
        out = gpu.alloc((M, I), np.uint16)
        gpu.memset(out, 0xFF)
        gemm.run(x, wd, out, M, swiglu=True)
        gpu.sync()
        outs.append(out.numpy())
    assert np.array_equal(outs[0], outs[1])


def test_planned_split_k_takes_dsmem_where_it_qualifies(gpu):
    """The plan's own choice: dsmem at 2..8 splits and <= 2 tiles a warp (the 8-row kernels), else the global path."""
    from ddtree.plugins.gemm import DSMEM_SPLITS, SkinnyGemm
    gemm = SkinnyGemm(gpu, 1536, 7168, 65, dsmem=True)
    for M in (1, 17, 65):
        p = gemm.plan(M)
        assert p.dsmem == (DSMEM_SPLITS[0] <= p.splits <= DSMEM_SPLITS[1] and p.tpw <= 2 and not p.tm), p
