"""CPU tests of ddtree/plugins/layout.py: exact round trips, and a numpy emulation of how the kernels
feed the layout to mma.m16n8k16 (fragment rules of the PTX ISA), checked against W @ x."""
import numpy as np
import pytest

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.model.int4 import dequantize_int4, pack_int4, quantize_int4
from ddtree.plugins import layout


def _random_q(rng, n, k):
    q = rng.integers(-8, 8, size=(n, k)).astype(np.int8)
    scale = f32_to_bf16(rng.uniform(0.005, 0.02, size=(n, k // 32)).astype(np.float32))
    return q, scale


def test_repack_round_trip_exact():
    rng = np.random.default_rng(0)
    q, scale = _random_q(rng, 64, 192)
    words, scales = layout.repack_q(q, scale)
    assert words.shape == (2, 3, 2, 32, 4) and words.dtype == np.int32
    assert scales.shape == (2, 3, 2, 8, 4) and scales.dtype == np.uint16
    q2, scale2 = layout.unpack_q(words, scales)
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(scale2, scale)


def test_expert_round_trip_from_checkpoint_format():
    rng = np.random.default_rng(1)
    inter, hidden = 64, 128
    tensors = {}
    for name, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
        q, s = quantize_int4(rng.standard_normal(shape).astype(np.float32))
        tensors[name] = (pack_int4(q), s, np.array(shape, dtype=np.int64))
    packed = layout.repack_expert(tensors["gate"], tensors["up"], tensors["down"])
    assert packed["gate_up"].shape == (2 * inter // 32, hidden // 64, 2, 32, 4)
    assert packed["down"].shape == (hidden // 32, inter // 64, 2, 32, 4)
    back = layout.unrepack_expert(packed)
    for name in ("gate", "up", "down"):
        np.testing.assert_array_equal(back[name][0], tensors[name][0])
        np.testing.assert_array_equal(back[name][1], tensors[name][1])
        np.testing.assert_array_equal(back[name][2], tensors[name][2])


def test_fused_tile_rows_are_gate_then_up():
    gate = np.arange(16 * 2).reshape(16, 2)
    up = 1000 + gate
    fused = layout.fuse_gate_up(gate, up)
    np.testing.assert_array_equal(fused[0:8], gate[0:8])
    np.testing.assert_array_equal(fused[8:16], up[0:8])
    np.testing.assert_array_equal(fused[16:24], gate[8:16])
    g2, u2 = layout.split_gate_up(fused)
    np.testing.assert_array_equal(g2, gate)
    np.testing.assert_array_equal(u2, up)


def test_bad_shapes_are_named():
    q = np.zeros((48, 64), dtype=np.int8)
    with pytest.raises(ValueError, match="down_proj.*N % 32"):
        layout.repack_q(q, np.zeros((48, 2), dtype=np.uint16), "down_proj")
    with pytest.raises(ValueError, match="o_proj: tile_bf16 needs"):
        layout.tile_bf16(np.zeros((16, 100), dtype=np.uint16), "o_proj")


def _emulate_kernel_tile(words, scales, x, tile, chunk):
    """What the W4 kernels compute for one (16-row tile, 64-k chunk) and 8 tokens x [8, 64]:
    per lane, dequantised A registers and B registers from the permuted k, assembled into the logical
    16x16 / 16x8 mma operands by the PTX fragment rules; scales applied per k32 group to fp32 sums."""
    out = np.zeros((16, 8))
    for h in range(2):
        part = np.zeros((16, 8))
        for u in range(2):
            a = np.zeros((16, 16))
            b = np.zeros((16, 8))
            for lane in range(32):
                g, t = lane // 4, lane % 4
                w = int(words[tile // 2, chunk, tile % 2, lane, 2 * h + u]) & 0xFFFFFFFF
                regs = [(((w >> 4 * j) & 0xF) - 8, ((w >> (4 * j + 16)) & 0xF) - 8) for j in range(4)]
                a[g, 2 * t:2 * t + 2] = regs[0]
                a[g + 8, 2 * t:2 * t + 2] = regs[1]
                a[g, 2 * t + 8:2 * t + 10] = regs[2]
                a[g + 8, 2 * t + 8:2 * t + 10] = regs[3]
                p = 32 * h + 8 * t + 4 * u
                b[2 * t:2 * t + 2, g] = x[g, p:p + 2]
                b[2 * t + 8:2 * t + 10, g] = x[g, p + 2:p + 4]
            part += a @ b
        s = scales[tile // 2, chunk, tile % 2]               # [g, (g,h0) (g+8,h0) (g,h1) (g+8,h1)]
        s_rows = np.concatenate([bf16_to_f32(s[:, 2 * h]), bf16_to_f32(s[:, 2 * h + 1])])   # [16]
        out += s_rows[:, None] * part
    return out


def test_fragment_emulation_matches_dense_product():
    rng = np.random.default_rng(2)
    q, scale = _random_q(rng, 32, 128)
    words, scales = layout.repack_q(q, scale)
    x = rng.standard_normal((8, 128))
    w = dequantize_int4(q, scale).astype(np.float64)        # [32, 128]
    for tile in range(2):
        got = sum(_emulate_kernel_tile(words, scales, x[:, 64 * c:64 * c + 64], tile, c) for c in range(2))
        want = w[16 * tile:16 * tile + 16] @ x.T
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_tile_bf16_round_trip_and_fragment_order():
    rng = np.random.default_rng(3)
    w = rng.integers(0, 1 << 16, size=(40, 128)).astype(np.uint16)     # 40 rows: padded to 48
    tiled = layout.tile_bf16(w)
    assert tiled.shape == (3, 2, 4, 32, 8)
    np.testing.assert_array_equal(layout.untile_bf16(tiled, 40), w)
    assert not tiled[2, :, 1].any()                                     # rows 40..47 (g+8 half) are padding
    g, t, h, rh, chunk = 5, 2, 1, 1, 1                                  # lane (g, t), block j = 2 h + rh
    np.testing.assert_array_equal(tiled[0, chunk, 2 * h + rh, 4 * g + t],
                                  w[8 * rh + g, 64 * chunk + 32 * h + 8 * t:64 * chunk + 32 * h + 8 * t + 8])
