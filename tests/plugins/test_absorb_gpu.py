"""GPU tests of the absorbed-MLA projections (kernels/mla_absorb.cu via plugins/mla_absorb.py) against their
float64 twins (plugins/reference.py mla_absorb_q / mla_absorb_out), at the tiny model's dims and Kimi's
(8 heads: tp 8, 64 heads: tp 1), for 1 .. 256 tokens (one and several token blocks, every K split).

Tolerance, argued: the inputs are exact bf16, the twin is exact in float64; the kernel sums K products in
fp32 (error <= K 2^-24 sum_k |x_k w_k|, taken at 2^-23 K for the mma's internal order) and rounds once to
bf16 (<= 2^-8 |y|, round to nearest). Each element must lie within 2^-8 |ref| + 2^-23 K sum |x w|; a wrong
head, row, stride or token is off by O(|y|). Outputs are poisoned with NaN first, so an unwritten element
fails; q_nope is read where it sits inside q_all (head stride Dn + Dr) with NaN in the rope columns.
"""
import numpy as np
import pytest

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.plugins import reference as twins

pytestmark = pytest.mark.gpu
# (heads N_r, Dn, Dr, Dv, R): tiny, Kimi at tp 8, Kimi at tp 1
DIMS = [(4, 32, 16, 32, 64), (8, 128, 64, 128, 512), (64, 128, 64, 128, 512)]
TOKENS = (1, 7, 33, 256)


def bf16(rng, shape, scale=1.0):
    return f32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def nan_buffer(gpu, shape):
    a = gpu.alloc(shape, np.uint16)
    gpu.memset(a, 0xFF)                       # bf16 0xFFFF is NaN
    return a


def check(got_bits, ref, bound, what):
    got = bf16_to_f32(got_bits).astype(np.float64)
    assert np.isfinite(got).all(), f"{what}: unwritten or non-finite output"
    excess = np.abs(got - ref) - (2.0 ** -8 * np.abs(ref) + bound)
    assert excess.max() <= 0, f"{what}: element {np.unravel_index(excess.argmax(), ref.shape)} off by " \
                              f"{np.abs(got - ref).flat[excess.argmax()]:.3e} (ref {ref.flat[excess.argmax()]:.3e})"


@pytest.mark.parametrize("M", TOKENS)
@pytest.mark.parametrize("dims", DIMS, ids=[f"n{d[0]}_dn{d[1]}_r{d[4]}" for d in DIMS])
def test_absorb_q_and_out_match_the_twins(gpu, dims, M):
    from ddtree.plugins.mla_absorb import MlaAbsorb, uk_transposed
    N, Dn, Dr, Dv, R = dims
    rng = np.random.default_rng(hash((dims, M)) % 2**32)
    kv_b = bf16(rng, (N * (Dn + Dv), R), R ** -0.5)
    q_all = bf16(rng, (M, N, Dn + Dr))
    q_all[:, :, Dn:] = 0xFFFF                                       # the rope columns must not be read
    o_lat = bf16(rng, (M, N, R))
    absorb = MlaAbsorb(gpu, N, Dn, Dv, R)
    w_uk_t, kv_b_dev = gpu.upload(uk_transposed(kv_b, N, Dn, Dv)), gpu.upload(kv_b)

    q_lat = nan_buffer(gpu, (M, N, R))
    absorb.q(gpu.upload(q_all), w_uk_t, q_lat, M, rope=Dr)
    q_nope = q_all[:, :, :Dn]
    ref = twins.mla_absorb_q(q_nope, kv_b, Dn, Dv)
    mass = twins.mla_absorb_q(np.abs(bf16_to_f32(q_nope)), np.abs(bf16_to_f32(kv_b)), Dn, Dv)
    check(q_lat.numpy(), ref, 2.0 ** -23 * Dn * mass, f"absorb_q {dims} M={M} plan {absorb.plan_q(M)}")

    o = nan_buffer(gpu, (M, N * Dv))
    absorb.out(gpu.upload(o_lat), kv_b_dev, o, M)
    ref = twins.mla_absorb_out(o_lat, kv_b, Dn, Dv)
    mass = twins.mla_absorb_out(np.abs(bf16_to_f32(o_lat)), np.abs(bf16_to_f32(kv_b)), Dn, Dv)
    check(o.numpy(), ref, 2.0 ** -23 * R * mass, f"absorb_out {dims} M={M} plan {absorb.plan_out(M)}")


def test_absorb_replays_in_a_graph_with_new_inputs(gpu):
    """Captured once, replayed after the inputs change in place: the launches hold no host-side state."""
    from ddtree.plugins.mla_absorb import MlaAbsorb, uk_transposed
    N, Dn, Dr, Dv, R, M = 8, 128, 64, 128, 512, 8
    rng = np.random.default_rng(7)
    kv_b = bf16(rng, (N * (Dn + Dv), R), R ** -0.5)
    absorb = MlaAbsorb(gpu, N, Dn, Dv, R)
    w_uk_t, kv_b_dev = gpu.upload(uk_transposed(kv_b, N, Dn, Dv)), gpu.upload(kv_b)
    q_all, q_lat = gpu.alloc((M, N, Dn + Dr), np.uint16), gpu.alloc((M, N, R), np.uint16)
    o = gpu.alloc((M, N * Dv), np.uint16)
    graph = gpu.capture(lambda s: (absorb.q(q_all, w_uk_t, q_lat, M, rope=Dr, stream=s),
                                   absorb.out(q_lat, kv_b_dev, o, M, stream=s)))
    for _ in range(2):
        x = bf16(rng, (M, N, Dn + Dr))
        gpu.copy_in(q_all, x)
        gpu.replay(graph)
        lat = q_lat.numpy()
        check(lat, twins.mla_absorb_q(x[:, :, :Dn], kv_b, Dn, Dv),
              2.0 ** -23 * Dn * twins.mla_absorb_q(np.abs(bf16_to_f32(x[:, :, :Dn])), np.abs(bf16_to_f32(kv_b)), Dn, Dv),
              "graph absorb_q")
        check(o.numpy(), twins.mla_absorb_out(lat, kv_b, Dn, Dv),
              2.0 ** -23 * R * twins.mla_absorb_out(np.abs(bf16_to_f32(lat)), np.abs(bf16_to_f32(kv_b)), Dn, Dv),
              "graph absorb_out")


def unfused_q_rope(gpu, absorb, q_all, w_uk_t, pos, table, M, buffer=None):
    """The two kernels the fused one replaces: absorb.q into q_lat and LayerOps.rope_interleaved from q_pe's
    strided view (inside q_all) into a dense q_rope; buffer(gpu, shape) allocates the outputs (default plain)."""
    from ddtree.plugins.layer_ops import LayerOps
    N, Dn, R, Dr = absorb.heads, absorb.nope, absorb.latent, table.dim
    buffer = buffer or (lambda g, shape: g.alloc(shape, np.uint16))
    q_lat, q_rope = buffer(gpu, (M, N, R)), buffer(gpu, (M, N, Dr))
    absorb.q(q_all, w_uk_t, q_lat, M, rope=Dr)
    LayerOps(gpu).rope_interleaved(q_rope, pos, table, M, N, src=q_all.view(Dn, (M, N * (Dn + Dr) - Dn)),
                                   src_token_stride=N * (Dn + Dr), src_head_stride=Dn + Dr)
    return q_lat, q_rope


@pytest.mark.parametrize("M", (1, 17, 65, 256))
@pytest.mark.parametrize("dims", DIMS, ids=[f"n{d[0]}_dn{d[1]}_r{d[4]}" for d in DIMS])
def test_absorb_q_rope_is_absorb_q_and_rope_interleaved(gpu, dims, M):
    """The fused query side (mla_absorb_q_rope_mt<MT>): q_lat bitwise absorb.q's on the same plan, q_rope bitwise
    LayerOps.rope_interleaved's from the strided view (a position past the table included: NaN in both), and the
    rope within the float64 twin's bound (one bf16 rounding, 2^-8 |y|, plus the fp32 products' ~1e-6 of the pair's
    magnitude m (|a| + |b|); the table is float64-built, so no angle error)."""
    from ddtree.model.presets import get_preset
    from ddtree.model.rope import rope_frequencies, rope_magnitude
    from ddtree.plugins.layer_ops import RopeTable
    from ddtree.plugins.mla_absorb import MlaAbsorb, uk_transposed
    N, Dn, Dr, Dv, R = dims
    cfg = get_preset("kimi-k2.6", layers=2)[0]
    rng = np.random.default_rng(hash((dims, M, "rope")) % 2**32)
    kv_b = bf16(rng, (N * (Dn + Dv), R), R ** -0.5)
    q_all = bf16(rng, (M, N, Dn + Dr))
    max_pos = 8192
    pos = rng.integers(0, max_pos, M).astype(np.int32)
    pos[-1] = max_pos if M > 1 else pos[-1]                          # past the table: that token's pairs are NaN
    table = RopeTable.interleaved(gpu, cfg.rope, Dr, max_pos)
    absorb = MlaAbsorb(gpu, N, Dn, Dv, R)
    w_uk_t, q_dev, pos_dev = gpu.upload(uk_transposed(kv_b, N, Dn, Dv)), gpu.upload(q_all), gpu.upload(pos)

    lat_ref, rope_ref = unfused_q_rope(gpu, absorb, q_dev, w_uk_t, pos_dev, table, M, nan_buffer)
    lat, rope = nan_buffer(gpu, (M, N, R)), nan_buffer(gpu, (M, N, Dr))
    absorb.q_rope(q_dev, w_uk_t, lat, rope, pos_dev, table, M)
    np.testing.assert_array_equal(lat.numpy(), lat_ref.numpy())
    got, want = rope.numpy(), rope_ref.numpy()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(q_dev.numpy(), q_all)             # the input is read, never written
    live = pos < max_pos
    assert np.isnan(bf16_to_f32(got[~live])).all()
    mag = rope_magnitude(cfg.rope)
    pe = q_all[live][:, :, Dn:]
    ref = twins.rope_interleaved(pe, pos[live], rope_frequencies(cfg.rope, Dr), mag)
    pair = np.abs(bf16_to_f32(pe)).reshape(*pe.shape[:2], Dr // 2, 2).sum(-1).repeat(2, axis=-1)
    check(got[live], ref, 1e-6 * mag * pair, f"rope {dims} M={M}")     # bf16 rounding + the fp32 products


def test_absorb_q_rope_replays_in_a_graph(gpu):
    """Captured once, replayed with new queries and positions written in place: both outputs follow."""
    from ddtree.model.presets import get_preset
    from ddtree.plugins.layer_ops import RopeTable
    from ddtree.plugins.mla_absorb import MlaAbsorb, uk_transposed
    N, Dn, Dr, Dv, R, M = 8, 128, 64, 128, 512, 17
    rng = np.random.default_rng(11)
    kv_b = bf16(rng, (N * (Dn + Dv), R), R ** -0.5)
    table = RopeTable.interleaved(gpu, get_preset("kimi-k2.6", layers=2)[0].rope, Dr, 4096)
    absorb = MlaAbsorb(gpu, N, Dn, Dv, R)
    w_uk_t = gpu.upload(uk_transposed(kv_b, N, Dn, Dv))
    q_all, pos = gpu.alloc((M, N, Dn + Dr), np.uint16), gpu.alloc((M,), np.int32)
    lat, rope = gpu.alloc((M, N, R), np.uint16), gpu.alloc((M, N, Dr), np.uint16)
    graph = gpu.capture(lambda s: absorb.q_rope(q_all, w_uk_t, lat, rope, pos, table, M, stream=s))
    for _ in range(2):
        x, p = bf16(rng, (M, N, Dn + Dr)), rng.integers(0, 4096, M).astype(np.int32)
        gpu.copy_in(q_all, x)
        gpu.copy_in(pos, p)
        gpu.replay(graph)
        lat_ref, rope_ref = unfused_q_rope(gpu, absorb, q_all, w_uk_t, pos, table, M)
        np.testing.assert_array_equal(lat.numpy(), lat_ref.numpy())
        np.testing.assert_array_equal(rope.numpy(), rope_ref.numpy())
