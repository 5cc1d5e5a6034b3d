"""GPU test of the split-K sums (kernels/common.cuh sum_partials, which loads a batch of partials before adding
them): a skinny GEMM's fp32 output at one row is, bit for bit, the sequential float32 sum in split order of the
k-splits' partials, which the kernel leaves in its workspace. 28 splits take two batches of 16 loads (the second
with four clamped repeats that must not be added), 14 one batch of 8 with two repeats (the cluster path's size),
16 one whole batch; and the sum is the float64 product's within tolerance."""
import numpy as np
import pytest
from test_kernels_gpu import assert_close

from ddtree.plugins import layout, randfill, reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("splits, warps, tpw", [(28, 4, 1), (16, 4, 1), (14, 8, 1), (7, 4, 2)])
def test_split_k_output_is_the_partials_summed_in_split_order(gpu, splits, warps, tpw):
    from ddtree.plugins.gemm import SkinnyGemm
    N, K = 512, 7168
    w = randfill.hash_array((N, K), np.uint16, 861, randfill.WEIGHT_BF16)
    x = randfill.hash_array((1, K), np.uint16, 862, randfill.ACT_BF16)
    gemm = SkinnyGemm(gpu, N, K, 1, out_f32=True, measured=False)
    p = gemm.override(1, splits=splits, warps=warps, tpw=tpw, dsmem=False)
    assert (p.splits, p.mb, p.mt, p.tm, p.dsmem) == (splits, 1, 1, False, False), p
    out = gpu.alloc((1, N), np.float32)
    gpu.memset(out, 0xFF)
    gemm.run(gpu.upload(x), gpu.upload(layout.tile_bf16(w)), out, 1)
    gpu.sync()
    got = out.numpy()[0]
    ntb = p.warps * p.tpw                                          # 16-row tiles a block
    part = gemm.partial.numpy()[: p.partial_floats].reshape(p.nb, splits, ntb, 32, 4)   # [nb, S, tile, lane, c]
    n = np.arange(N)
    tile, row = n // 16, n % 16
    # token 0 is lane g * 4 (t = 0): C fragment component 0 holds tile row g, component 2 row g + 8
    per_split = part[tile // ntb, :, tile % ntb, (row % 8) * 4, np.where(row < 8, 0, 2)]   # [N, S]
    want = np.zeros(N, np.float32)
    for s in range(splits):                                        # float32 adds in split order, from 0
        want += per_split[:, s]
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"S={splits}: {bad.size} outputs are not the split-order sum, e.g. n={bad[:4]} " \
                          f"got {got[bad[:4]]} want {want[bad[:4]]}"
    assert_close(got, reference.gemm(x, w)[0], atol_rms=2e-3, what=f"split-K gemm S={splits}")
