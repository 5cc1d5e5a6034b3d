"""GPU tests of the skinny GEMM with the tokens as the mma's M side (kernels/gemm_tm.cuh, the plan past 16 rows):
against float64 numpy under forced (warps, tiles a warp, splits) plans and token blocks of 2..5 tiles of 16 rows
(17..256 rows, ragged M and N, fp32 out, the residual), a row's bits independent of the rows beside it, and within
one bf16 rounding of the 8-row kernels (the same k order chunk by chunk; the mma's internal order may differ)."""
import numpy as np
import pytest
from test_kernels_gpu import assert_close

from ddtree.model.bf16 import bf16_to_f32
from ddtree.plugins import layout, randfill, reference

pytestmark = pytest.mark.gpu
# name: (N, K, residual, out_f32)
SHAPES = {"q_a": (1536, 7168, False, False), "o_proj_res": (7168, 1024, True, False),
          "router_f32": (384, 7168, False, True), "ragged_n": (200, 512, True, False)}
PLANS = [dict(), dict(warps=4, tpw=1), dict(warps=8, tpw=2), dict(warps=4, tpw=2, splits=1)]


def gemm_case(gpu, name, shape, seed, rows, **gemm_kw):
    """A skinny GEMM case for these files: random bf16 w [N, K] (tiled), x [rows, K] and the residual, the float64
    reference, an output buffer, and SkinnyGemm(**gemm_kw) for up to `rows` rows. shape = (N, K, residual, out_f32)."""
    from ddtree.plugins.gemm import SkinnyGemm
    N, K, residual, out_f32 = shape
    w = randfill.hash_array((N, K), np.uint16, seed, randfill.WEIGHT_BF16)
    x = randfill.hash_array((rows, K), np.uint16, seed + 1, randfill.ACT_BF16)
    res = randfill.hash_array((rows, N), np.uint16, seed + 2, randfill.ACT_BF16) if residual else None
    return dict(name=name, gemm=SkinnyGemm(gpu, N, K, rows, out_f32=out_f32, **gemm_kw),
                w=gpu.upload(layout.tile_bf16(w)), x=gpu.upload(x), res=None if res is None else gpu.upload(res), ref=reference.gemm(x, w, res),
                out=gpu.alloc((rows, N), np.float32 if out_f32 else np.uint16), out_f32=out_f32, K=K)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def tm_case(gpu, request):
    seed = 700 + 10 * sorted(SHAPES).index(request.param)
    return gemm_case(gpu, request.param, SHAPES[request.param], seed, 256, tm=True)


def run_plan(gpu, c, M, **plan):
    """out[:M] under the forced plan (none: SkinnyGemm's own), poisoned first; returns (plan, out copy)."""
    try:
        p = c["gemm"].override(M, **plan) if plan else c["gemm"].plan(M)
        gpu.memset(c["out"], 0xFF)
        c["gemm"].run(c["x"], c["w"], c["out"], M, residual=c["res"])
        gpu.sync()
        return p, c["out"].numpy()[:M].copy()
    finally:
        c["gemm"]._overrides.clear()


def as_f64(c, y):
    return y.astype(np.float64) if c["out_f32"] else bf16_to_f32(y).astype(np.float64)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: ",".join(f"{k}{v}" for k, v in p.items()) or "planned")
@pytest.mark.parametrize("M", [17, 31, 48, 65, 80, 81, 200, 256])
def test_tokens_as_m_against_numpy(gpu, tm_case, M, plan):
    c = tm_case
    try:
        p, y = run_plan(gpu, c, M, **plan, **({"tm": True} if plan else {}))
    except ValueError as exc:                                  # one split: the token rows can exceed the smem
        assert "shared memory" in str(exc), exc
        pytest.skip(str(exc))
    assert p.tm and p.kernel == f"gemm_bf16_tm{p.mt}_g{p.tpw}" and p.mt <= 5 and p.mt * p.mb * 16 >= M, p
    assert p.mb == -(-(-(-M // 16)) // 5), p                     # the fewest blocks of <= 5 tiles of 16 rows
    assert_close(as_f64(c, y), c["ref"][:M], atol_rms=2e-3, what=f"gemm tm {c['name']} {p} M={M}")


@pytest.mark.parametrize("M", [17, 65])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(gpu, tm_case, M):
    """Rows 0..16 of a 17-row call equal the same rows of an M-row call at the same (warps, tpw, splits): 2 and
    5 tiles of 16 rows, only the token tile count differs."""
    c = tm_case
    p = c["gemm"].plan(80)
    knobs = dict(warps=p.warps, tpw=p.tpw, splits=p.splits, tm=True)
    _, small = run_plan(gpu, c, 17, **knobs)
    _, big = run_plan(gpu, c, M, **knobs)
    assert np.array_equal(small.view(np.uint8), big[:17].view(np.uint8)), f"gemm tm {c['name']} M={M}"


@pytest.mark.parametrize("M", [17, 40, 48])
def test_tokens_as_m_within_a_rounding_of_the_8_row_kernels(gpu, tm_case, M):
    """Same (warps, tpw, splits) as the 8-row kernels' plan: the fp32 sums agree to float rounding, so bf16
    outputs differ by at most one bf16 ulp (2^-7 of the value) and fp32 outputs by a few float ulps of the row's
    scale. (The 8-row plan sizes its token rows for a power-of-two tile, 32 / 64 rows here, so tm's fit too.)"""
    c = tm_case
    p = c["gemm"].override(M, tm=False)
    knobs = dict(warps=p.warps, tpw=p.tpw, splits=p.splits)
    _, tm = run_plan(gpu, c, M, tm=True, **knobs)
    _, mt = run_plan(gpu, c, M, tm=False, **knobs)
    if c["out_f32"]:
        scale = np.abs(c["ref"][:M]).max(axis=1, keepdims=True)
        assert (np.abs(tm - mt) <= 1e-5 * scale).all(), f"gemm {c['name']} M={M}: tm vs mt fp32"
    else:
        a, b = bf16_to_f32(tm).astype(np.float64), bf16_to_f32(mt).astype(np.float64)
        scale = np.abs(c["ref"][:M]).max(axis=1, keepdims=True)
        bound = 2.0 ** -7 * np.maximum(np.abs(a), np.abs(b)) + 1e-5 * scale
        assert np.isfinite(a).all() and (np.abs(a - b) <= bound).all(), f"gemm {c['name']} M={M}: tm vs mt"
