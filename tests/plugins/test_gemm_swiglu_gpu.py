"""The skinny GEMM's SwiGLU epilogue (gemm.cu swiglu, what CudaOps.swiglu_mlp runs): against the unfused pair it
replaced (the [gate; up] GEMM to [M, 2I] then LayerOps.silu_mul) bitwise, and against numpy, at the tp 8 shared
expert's shape (I = 256 of 7168, split-K plans), the tiny model's (I = 512 of 128) and tp 8 dense layer 0's (I = 2304
of 7168), M from 1 to 65, under the plan's choice and four tiles a warp in one token block."""
import numpy as np
import pytest

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.plugins import layout, reference

pytestmark = pytest.mark.gpu


# the plan's choice (tokens as the mma's M side past 16 rows), four tiles a warp with one token block of up to 9
# sub-tiles (gemm_bf16_mt<MT>_g4 at 17..72 rows; the one-tile loop of that tpw below), and tm with two tiles a warp
PLANS = {"planned": None, "g4_mt9": dict(warps=4, tpw=4, max_mt=9, tm=False), "tm_w8_t2": dict(warps=8, tpw=2, tm=True)}


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("I, K", [(256, 7168), (512, 128), (2304, 7168)])
@pytest.mark.parametrize("M", [1, 5, 17, 65])
def test_swiglu_epilogue_is_the_unfused_pair_bitwise(gpu, I, K, M, plan):
    from ddtree.plugins.gemm import SkinnyGemm
    from ddtree.plugins.layer_ops import LayerOps
    rng = np.random.default_rng(I + K + M)
    gate, up = (f32_to_bf16(rng.standard_normal((I, K)).astype(np.float32) * 0.03) for _ in range(2))
    x = f32_to_bf16(rng.standard_normal((M, K)).astype(np.float32))
    xd = gpu.upload(x)
    gemm = SkinnyGemm(gpu, 2 * I, K, 256)
    if plan.startswith("tm") and M <= 16:
        pytest.skip("the tokens-as-M kernels take M > 16")
    if PLANS[plan]:
        gemm.override(M, **PLANS[plan])

    fused = gpu.alloc((M, I), np.uint16)
    gpu.memset(fused, 0xFF)
    gemm.run(xd, gpu.upload(layout.tile_bf16(layout.fuse_gate_up(gate, up))), fused, M, swiglu=True)
    gu, unfused = gpu.alloc((M, 2 * I), np.uint16), gpu.alloc((M, I), np.uint16)
    gemm.run(xd, gpu.upload(layout.tile_bf16(np.concatenate([gate, up]))), gu, M)
    LayerOps(gpu).silu_mul(gu, unfused, M, I)
    gpu.sync()
    assert np.array_equal(fused.numpy(), unfused.numpy())

    xf = bf16_to_f32(x).astype(np.float64)
    want = reference.silu_mul(np.concatenate([xf @ bf16_to_f32(gate).T, xf @ bf16_to_f32(up).T], axis=1))
    got = bf16_to_f32(fused.numpy())
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()


def test_swiglu_needs_whole_channel_tiles(gpu):
    from ddtree.plugins.gemm import SkinnyGemm
    with pytest.raises(ValueError, match="swiglu: needs N % 16 == 0"):
        SkinnyGemm(gpu, 24, 64, 8).run(0, 0, 0, 1, swiglu=True)
