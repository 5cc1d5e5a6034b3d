"""CPU tests of the per-layer kernels' host side (plugins/layer_ops.py): the rope table is the float64
cos/sin rounded once to fp32 (and an fp32 angle would not be), the twins agree with the op set's numpy
math, and the launchers refuse shapes the kernels cannot take before launching anything."""
from types import SimpleNamespace

import numpy as np
import pytest

from ddtree.backends import numpy_math
from ddtree.model.presets import get_preset
from ddtree.model.rope import rope_frequencies, rope_magnitude
from ddtree.plugins import reference
from ddtree.plugins.layer_ops import LayerOps, rope_table

KIMI_ROPE = get_preset("kimi-k2.6", layers=2)[0].rope
MAX_POS = 262144                                   # Kimi's max_position_embeddings


def test_rope_table_is_float64_rounded_once_at_large_positions():
    freqs = rope_frequencies(KIMI_ROPE, 64)
    mag = rope_magnitude(KIMI_ROPE)
    table = rope_table(freqs, mag, MAX_POS)                                 # [P, 32, 2] float32
    assert table.shape == (MAX_POS, 32, 2) and table.dtype == np.float32
    p = np.array([0, 1, 4095, 4096, 65535, 131071, 200003, 262142, 262143])
    angle = p[:, None] * freqs[None, :]
    exact = np.stack([np.cos(angle), np.sin(angle)], axis=-1) * mag
    # one fp32 rounding of a value of magnitude <= mag: at most half an ulp of 1.0, 2^-24 mag
    assert np.abs(table[p] - exact).max() <= 2.0 ** -24 * mag
    # why the table: the same cos from an fp32 angle p phi_i is off by ~1e-2 at p ~ 2.6e5 (ulp of 1e5 rad is 2^-7)
    p32 = (p[-3:, None].astype(np.float32) * freqs[None, :].astype(np.float32))
    naive = np.cos(p32.astype(np.float64)) * mag
    assert np.abs(naive - exact[-3:, :, 0]).max() > 5e-3


def test_twins_agree_with_the_op_set_math():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 16))
    pos = np.array([0, 7, 100, 4097, 262143])
    freqs = rope_frequencies(KIMI_ROPE, 16)
    np.testing.assert_allclose(reference.rope_interleaved(x, pos, freqs, rope_magnitude(KIMI_ROPE)),
                               numpy_math.rope_interleaved(x, pos, KIMI_ROPE), atol=1e-12)
    np.testing.assert_allclose(reference.rope_rotate_half(x, pos, freqs, 1.25),
                               numpy_math.rope_rotate_half(x, pos, freqs, 1.25), atol=1e-12)
    w = rng.standard_normal(16)
    np.testing.assert_allclose(reference.rms_norm(x, w, 1e-6), numpy_math.rms_norm(x, w, 1e-6), atol=1e-12)
    table = rng.integers(0, 2 ** 15, (6, 8)).astype(np.uint16)
    ids = np.array([3, 9, 14, 10, 0])
    np.testing.assert_array_equal(reference.embed(ids, table, 9).view(np.uint16),
                                  np.where(np.isin(ids, range(9, 15))[:, None], table[np.clip(ids - 9, 0, 5)], 0))


class FakeGpu:
    """Records launches: the argument checks must fire before any launch."""
    arch, sm_count = "sm_90", 132

    def __init__(self):
        self.launches = []

    def kernel(self, source, name):
        return name

    def launch(self, kernel, grid, block, smem, *args, stream=None, pdl=False):
        self.launches.append((kernel, grid, block))


@pytest.mark.parametrize("call, match", [
    (lambda o: o.rms_norm(0, 0, 0, 4, 100, 1e-6), "D = 100 must be a multiple of 8"),
    (lambda o: o.rms_norm(0, 0, 0, 4, 512, 1e-6, x_stride=580), "x_stride = 580 must be a multiple of 8"),
    (lambda o: o.rms_norm(8, 0, 0, 4, 512, 1e-6), "rms_norm x: address 0x8 is not 16-byte aligned"),
    (lambda o: o.add_rms_norm(0, 0, 0, 0, 0, 7168, 1e-6), "m = 0 must be >= 1"),
    (lambda o: o.add_rms_norm(0, 0, 0, 0, 2, 7168, 1e-6, h_in=8), "add_rms_norm h_in: address 0x8"),
    (lambda o: o.add(0, 0, 0, 12), "n = 12 must be a multiple of 8"),
    (lambda o: o.rope_interleaved(0, 0, SimpleNamespace(dim=64, table=0, max_pos=8), 2, 1, src=0,
                                  src_token_stride=65), "src_token_stride = 65 must be a multiple of 2"),
    (lambda o: o.embed(0, 0, 0, 3, 100, 0, 10), "H = 100 must be a multiple of 8"),
    (lambda o: o.head_rms_norm(0, 0, 2, 4, 15, 1e-6), "d = 15 must be a multiple of 2"),
    (lambda o: o.silu_mul(0, 0, 2, 7), "I = 7 must be a multiple of 2"),
    (lambda o: o.gather_rows(0, 0, 0, 2, 12, 5), "W = 12 elements of 2 B must be a multiple of 16 B"),
    (lambda o: o.cast_f32_bf16(0, 0, 0), "n = 0 must be >= 1"),
    (lambda o: o.rms_norm(0, 0, 0, 12, 128, 1e-6, x_stride=128, x_group=8, x_group_stride=1280),
     "m = 12 must be >= 1 and a multiple of x_group = 8"),
    (lambda o: o.rms_norm(0, 0, 0, 16, 128, 1e-6, x_stride=128, x_group=8, x_group_stride=512),
     "x_group_stride 512 >= x_group x_stride"),
    (lambda o: o.rows_at(0, 9, 0, 0, 2, 128, src_stride=64), "src_stride = 64 >= W")])
def test_launchers_refuse_bad_shapes_before_launching(call, match):
    gpu = FakeGpu()
    with pytest.raises(ValueError, match=match):
        call(LayerOps(gpu))
    assert gpu.launches == []


def test_launch_geometry():
    gpu = FakeGpu()
    ops = LayerOps(gpu)
    ops.rms_norm(0, 0, 0, 3, 7168, 1e-6)                   # 896 vectors: 256 threads, one block per row
    ops.rms_norm(0, 0, 0, 3, 64, 1e-6)                     # 8 vectors: one warp
    ops.head_rms_norm(0, 0, 5, 8, 128, 1e-6)               # 40 rows, 4 per block
    ops.gather_rows(0, 0, 0, 7, 16, 10, itemsize=4)        # 64 B rows: 4 vectors
    assert gpu.launches == [("rms_norm_rows", 3, 256), ("rms_norm_rows", 3, 32), ("head_rms_norm", 10, 128),
                            ("gather_rows", 7, 32)]
    assert ops.pdl and not LayerOps(gpu, pdl=False).pdl


class ArgsGpu(FakeGpu):
    """FakeGpu that keeps each launch's arguments too."""

    def launch(self, kernel, grid, block, smem, *args, stream=None, pdl=False):
        self.launches.append((kernel, grid, block, tuple(int(a) if isinstance(a, (int, np.integer)) else a
                                                          for a in args)))


def test_the_drafters_column_slices_reach_the_kernels_with_their_strides():
    """CudaOps over a recording GPU: q of the drafter's [b, q | k | v] GEMM output (8 heads of 128 in rows of 1280)
    is normed as 8 rows a token, tokens 1280 apart (rms_norm_rows' x_group); k (one head) as rows 1280 apart; the
    context's v of its [n, k | v] output goes to rows_at with its source stride (in 16-byte vectors)."""
    from dataclasses import replace

    from ddtree.backends.cuda_backend import CudaOps
    from ddtree.backends.cuda_tensor import Tensor, dense_strides
    gpu = ArgsGpu()
    ops = object.__new__(CudaOps)
    ops.k, ops.stream, ops.where = LayerOps(gpu), None, "test"
    ops.new = lambda shape, dtype: Tensor(1 << 20, tuple(shape), np.dtype(dtype), dense_strides(tuple(shape)))
    b, bf16 = 8, np.dtype(np.uint16)
    y = Tensor(4096, (b, 1280), bf16, (1280, 1))
    q = ops.reshape(ops.slice(y, 1, 0, 1024), [0, 8, 128])
    k = ops.reshape(ops.slice(y, 1, 1024, 1152), [0, 1, 128])
    v = ops.reshape(ops.slice(y, 1, 1152, 1280), [0, 1, 128])
    w = Tensor(64, (128,), bf16, (1,))
    assert ops.rms_norm(q, w, 1e-6).shape == (b, 8, 128) and ops.rms_norm(k, w, 1e-6).shape == (b, 1, 128)
    (name, rows, _, args_q), (_, rows_k, _, args_k) = gpu.launches
    # x, x_stride, x_group, x_group_stride, w, out, out_stride, D, eps
    assert (name, rows, args_q[0], args_q[1:4]) == ("rms_norm_rows", 64, 4096, (128, 8, 1280))
    assert (rows_k, args_k[0], args_k[1:4]) == (b, 4096 + 2048, (1280, 1, 1280))
    assert v.token_stride(128, "v") == 1280 and v.ptr == 4096 + 2 * 1152
    for shape, strides, width in (((b, 2, 64), (1280, 128, 1), 128), ((b, 1, 128), (1280, 128, 1), 256)):
        with pytest.raises(ValueError, match=f"not rows of {width} dense values"):   # heads apart / too narrow
            replace(v, shape=shape, strides=strides).token_stride(width, "v")
    gpu.launches.clear()
    ctx = Tensor(8192, (5, 256), bf16, (256, 1))
    ctx_v = ops.reshape(ops.slice(ctx, 1, 128, 256), [0, 1, 128])
    ops.k.rows_at(0, 100, 0, ctx_v.ptr, 5, 128, src_stride=ctx_v.token_stride(128, "ctx_v"))
    (name, n, _, args), = gpu.launches
    # dst, dst_stride, dst_rows, row0, src, src_stride, row_vecs (16-byte vectors)
    assert (name, n, args[4], args[5], args[6]) == ("rows_at", 5, 8192 + 256, 32, 16)
