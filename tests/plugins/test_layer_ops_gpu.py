"""GPU tests of the per-layer kernels (kernels/layer_ops.cu) against their numpy twins (plugins/reference.py),
at the tiny model's dims (H 128, d 16 / 32, heads 4 / 8) and Kimi K2.6's (H 7168, R 512, Dr 64, Q 1536,
heads 8 .. 64, drafter d 128), with strided views inside wider buffers and positions up to 262143.

Error rule for a bf16 output y of fp32 math against the float64 twin r (per element):
    |y - r| <= 2^-8 |r| + atol
  y = bf16(v) rounds the kernel's fp32 value v to nearest even: |y - v| <= 2^-9 |v|. The fp32 math moves v
  from r by far less than 2^-9 |r|: a norm's sum of D squares in fp32 is within D 2^-24 <= 4.3e-4 (D = 7168,
  worst case of any summation order) relative, so its rsqrt within 2.2e-4, and the products add ~2^-23; so
  |y - r| <= 2^-9 (1 + 3e-4) |r| + 3e-4 |r| < 2^-8 |r|. Norms and silu * up are products (relative error,
  atol 0). A rope output is a difference a c - b s that can cancel: its fp32 error is absolute, ~3 2^-24 m
  (|a| + |b|) (table rounding 2^-24 m, two products and a sum), so atol = 1e-6 m (|a| + |b|) per pair.
Copies (embed, gather, the residual h after add + norm, the cast) must match bit for bit.
Outputs are poisoned with 0xFF bytes (bf16 NaN) before each launch, so an unwritten element fails.
"""
import numpy as np
import pytest

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.model.presets import get_preset
from ddtree.model.rope import rope_frequencies, rope_magnitude
from ddtree.plugins import reference

pytestmark = pytest.mark.gpu
MAX_POS = 262144                          # Kimi's max_position_embeddings: positions up to 262143
TINY_T, TINY_D = get_preset("tiny")[:2]
KIMI_T, KIMI_D = get_preset("kimi-k2.6", layers=2)[:2]


@pytest.fixture(scope="module")
def ops(gpu):
    from ddtree.plugins.layer_ops import LayerOps
    return LayerOps(gpu)


def bits(rng, shape, scale=1.0) -> np.ndarray:
    return f32_to_bf16(rng.standard_normal(shape) * scale)


def poisoned(gpu, shape, dtype=np.uint16):
    a = gpu.alloc(shape, dtype)
    gpu.memset(a, 0xFF)
    return a


def assert_bf16(y_bits, ref, atol=0.0, what=""):
    y, ref = bf16_to_f32(np.asarray(y_bits)).astype(np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(y).all(), f"{what}: non-finite output (unwritten?)"
    excess = np.abs(y - ref) - (2.0 ** -8 * np.abs(ref) + atol)
    assert excess.max() <= 0, f"{what}: element {np.unravel_index(excess.argmax(), y.shape)} off by " \
                              f"{np.abs(y - ref).max():.3e}"


# ---- embed ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("H, V_r, start", [(TINY_T.hidden_size, 64, 64), (KIMI_T.hidden_size, 20480, 20480)])
def test_embed(gpu, ops, H, V_r, start):
    rng = np.random.default_rng(H)
    table = bits(rng, (V_r, H))
    ids = np.array([start, start - 1, start + V_r - 1, start + V_r, 0, start + 7, 2 ** 31 - 1,
                    *rng.integers(0, 2 * start + V_r, 9)], np.int32)
    out = poisoned(gpu, (len(ids), H))
    ops.embed(gpu.upload(ids), gpu.upload(table), out, len(ids), H, start, V_r)
    np.testing.assert_array_equal(out.numpy(), reference.embed(ids, table, start))


# ---- norms ---------------------------------------------------------------------------------------------

NORMS = {  # name: (m, D, x_stride, x column offset)
    "tiny hidden": (5, TINY_T.hidden_size, None, 0),
    "tiny c_kv in latent": (7, TINY_T.kv_lora_rank, TINY_T.kv_lora_rank + TINY_T.qk_rope_head_dim, 0),
    "kimi hidden": (16, KIMI_T.hidden_size, None, 0),
    "kimi c_q": (3, KIMI_T.q_lora_rank, None, 0),
    "kimi c_kv in latent": (9, KIMI_T.kv_lora_rank, KIMI_T.kv_lora_rank + KIMI_T.qk_rope_head_dim, 0),
    "kimi column slice": (4, 512, 1024, 256),
}


@pytest.mark.parametrize("name", sorted(NORMS))
def test_rms_norm(gpu, ops, name):
    m, D, stride, col = NORMS[name]
    stride = stride or D
    rng = np.random.default_rng(len(name))
    x, w = bits(rng, (m, stride), 3.0), bits(rng, D, 0.5)
    out = poisoned(gpu, (m, D + 8))                                   # rows D + 8 apart: out_stride honoured
    xd = gpu.upload(x)
    ops.rms_norm(xd.view(col, (m, D)), gpu.upload(w), out, m, D, 1e-6, x_stride=stride, out_stride=D + 8)
    y = out.numpy()
    assert_bf16(y[:, :D], reference.rms_norm(x[:, col: col + D], w, 1e-6), what=name)
    assert (y[:, D:] == 0xFFFF).all(), "wrote past the row"
    ops.rms_norm(xd.view(col, (m, D)), gpu.upload(w), xd.view(col, (m, D)), m, D, 1e-6, x_stride=stride,
                 out_stride=stride)                                   # in place
    np.testing.assert_array_equal(xd.numpy()[:, col: col + D], y[:, :D])
    np.testing.assert_array_equal(np.delete(xd.numpy(), np.s_[col: col + D], axis=1),
                                  np.delete(x, np.s_[col: col + D], axis=1))


# the drafter's q and k of its q | k | v GEMM output: (tokens, heads, d, the output's width, the slice's first column)
HEAD_SLICES = [(8, 8, 128, 1280, 0), (8, 1, 128, 1280, 1024), (5, 8, 32, 512, 0), (3, 4, 32, 512, 256)]


@pytest.mark.parametrize("case", HEAD_SLICES, ids=[f"q{q}_n{n}_d{d}_w{W}_at{c}" for q, n, d, W, c in HEAD_SLICES])
def test_rms_norm_of_the_heads_of_a_column_slice(gpu, ops, case):
    """x_group: rows (token t, head j) at t W + c + j d, each normed alone (the twin per row), out dense."""
    q, n, d, W, col = case
    rng = np.random.default_rng(W + col + n)
    x, w = bits(rng, (q, W), 3.0), bits(rng, d, 0.5)
    out = poisoned(gpu, (q * n + 1, d))                                 # one row past the end: untouched
    ops.rms_norm(gpu.upload(x).view(col, (q, n * d)), gpu.upload(w), out, q * n, d, 1e-6, x_stride=d, x_group=n,
                 x_group_stride=W)
    y = out.numpy()
    want = reference.rms_norm(x[:, col: col + n * d].reshape(q * n, d), w, 1e-6)
    assert_bf16(y[: q * n], want, what=f"heads {case}")
    assert (y[q * n:] == 0xFFFF).all(), "wrote past the rows"


@pytest.mark.parametrize("m, D", [(5, TINY_T.hidden_size), (16, KIMI_T.hidden_size), (1, KIMI_T.hidden_size)])
def test_add_rms_norm(gpu, ops, m, D):
    rng = np.random.default_rng(D + m)
    h, delta, w = bits(rng, (m, D), 4.0), bits(rng, (m, D), 1.0), bits(rng, D, 0.5)
    hd, out = gpu.upload(h), poisoned(gpu, (m, D))
    ops.add_rms_norm(hd, gpu.upload(delta), gpu.upload(w), out, m, D, 1e-6)
    h1, ref = reference.add_rms_norm(h, delta, w, 1e-6)
    np.testing.assert_array_equal(hd.numpy(), h1)                    # the residual stream, bit for bit
    assert_bf16(out.numpy(), ref, what=f"add_rms_norm {m}x{D}")
    h_in, h_out, out2 = gpu.upload(h), poisoned(gpu, (m, D)), poisoned(gpu, (m, D))   # out of place (h_in kept)
    ops.add_rms_norm(h_out, gpu.upload(delta), gpu.upload(w), out2, m, D, 1e-6, h_in=h_in)
    np.testing.assert_array_equal(h_out.numpy(), h1)
    np.testing.assert_array_equal(h_in.numpy(), h)
    np.testing.assert_array_equal(out2.numpy(), out.numpy())


@pytest.mark.parametrize("n", [8, TINY_T.hidden_size * 5, KIMI_T.hidden_size * 17])
def test_add_is_add_rms_norms_residual(gpu, ops, n):
    rng = np.random.default_rng(n)
    a, b = bits(rng, (1, n), 4.0), bits(rng, (1, n), 1.0)
    out = poisoned(gpu, (1, n))
    ops.add(gpu.upload(a), gpu.upload(b), out, n)
    np.testing.assert_array_equal(out.numpy(), reference.add_rms_norm(a, b, np.full(n, 0x3F80, np.uint16), 1e-6)[0])


HEAD_NORMS = {  # name: (m, n, d, head_stride)
    "tiny q": (16, TINY_D.num_attention_heads, TINY_D.head_dim, None),
    "tiny k padded heads": (16, TINY_D.num_key_value_heads, TINY_D.head_dim, TINY_D.head_dim + 8),
    "kimi q tp8": (16, 8, KIMI_D.head_dim, None),
    "kimi q tp1": (16, KIMI_D.num_attention_heads, KIMI_D.head_dim, None),
    "kimi k padded": (33, KIMI_D.num_key_value_heads, KIMI_D.head_dim, KIMI_D.head_dim + 64),
}


@pytest.mark.parametrize("name", sorted(HEAD_NORMS))
def test_head_rms_norm(gpu, ops, name):
    m, n, d, hs = HEAD_NORMS[name]
    hs = hs or d
    rng = np.random.default_rng(n * d + m)
    x, w = bits(rng, (m, n, hs), 2.0), bits(rng, d, 0.5)
    xd = gpu.upload(x)
    ops.head_rms_norm(xd, gpu.upload(w), m, n, d, 1e-6, token_stride=n * hs, head_stride=hs)
    y = xd.numpy()
    assert_bf16(y[..., :d], reference.head_rms_norm(x[..., :d], w, 1e-6), what=name)
    np.testing.assert_array_equal(y[..., d:], x[..., d:])            # the padding is not touched


# ---- rope ----------------------------------------------------------------------------------------------

def positions(q: int, rng) -> np.ndarray:
    fixed = [0, 1, 4095, 4096, 65535, 131072, 262142, 262143]
    return np.array((fixed + list(rng.integers(0, MAX_POS, max(0, q - len(fixed)))))[:q], np.int32)


ROPES = {  # name: (cfg, q, heads, rope dim, width of a token's row, column of head 0, head stride)
    "tiny q_pe in q_b out": (TINY_T, 12, 4, 16, 4 * 48, 32, 48),
    "tiny k_pe in latent": (TINY_T, 12, 1, 16, 80, 64, 0),
    "kimi q_pe tp8": (KIMI_T, 16, 8, 64, 8 * 192, 128, 192),
    "kimi q_pe tp1": (KIMI_T, 9, 64, 64, 64 * 192, 128, 192),
    "kimi k_pe in latent": (KIMI_T, 16, 1, 64, 576, 512, 0),
}


def strided_rope_case(gpu, name, seed):
    cfg, q, n, d, width, col, hs = ROPES[name]
    rng = np.random.default_rng(seed)
    x = f32_to_bf16(rng.uniform(-1, 1, (q, width)))                  # |x| <= 1: the 1e-2 absolute bound below
    heads = np.stack([x[:, col + h * hs: col + h * hs + d] for h in range(n)], axis=1)   # [q, n, d]
    return cfg, q, n, d, width, col, hs, rng, x, heads


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_interleaved(gpu, ops, name):
    from ddtree.plugins.layer_ops import RopeTable
    cfg, q, n, d, width, col, hs, rng, x, heads = strided_rope_case(gpu, name, 7)
    table = RopeTable.interleaved(gpu, cfg.rope, d, MAX_POS)
    pos = positions(q, rng)
    xd = gpu.upload(x)
    ops.rope_interleaved(xd.view(col, (q, width - col)), gpu.upload(pos), table, q, n, token_stride=width,
                         head_stride=hs)
    y = xd.numpy()
    got = np.stack([y[:, col + h * hs: col + h * hs + d] for h in range(n)], axis=1)
    mag = rope_magnitude(cfg.rope)
    ref = reference.rope_interleaved(heads, pos, rope_frequencies(cfg.rope, d), mag)
    pair = np.abs(bf16_to_f32(heads)).reshape(q, n, d // 2, 2).sum(-1).repeat(2, axis=-1)
    assert_bf16(got, ref, atol=1e-6 * mag * pair, what=name)
    # |x| <= 1, so |y| <= sqrt(2) m: bf16 rounding <= 2^-9 sqrt(2) m ~ 2.8e-3 m, the fp32 math ~1e-6: the
    # output is within 1e-2 of float64 at every position, 262143 included (an fp32 angle is not: see
    # tests/plugins/test_layer_ops.py)
    assert np.abs(bf16_to_f32(got) - ref).max() <= 1e-2 * mag
    untouched = np.ones(width, bool)
    for h in range(n):
        untouched[col + h * hs: col + h * hs + d] = False
    np.testing.assert_array_equal(y[:, untouched], x[:, untouched])
    src, dense = gpu.upload(x), poisoned(gpu, (q, n, d))             # the strided view roped into a dense copy
    ops.rope_interleaved(dense, gpu.upload(pos), table, q, n, src=src.view(col, (q, width - col)),
                         src_token_stride=width, src_head_stride=hs)
    np.testing.assert_array_equal(dense.numpy(), got)
    np.testing.assert_array_equal(src.numpy(), x)


DRAFT_ROPES = {  # name: (drafter cfg, q, heads, head stride (>= d), attention factor)
    "tiny q": (TINY_D, 16, TINY_D.num_attention_heads, TINY_D.head_dim, TINY_D.attention_factor),
    "tiny k padded, factor 1.25": (TINY_D, 16, TINY_D.num_key_value_heads, TINY_D.head_dim + 8, 1.25),
    "kimi q tp8": (KIMI_D, 16, 8, KIMI_D.head_dim, KIMI_D.attention_factor),
    "kimi q tp1": (KIMI_D, 16, KIMI_D.num_attention_heads, KIMI_D.head_dim, KIMI_D.attention_factor),
    "kimi context k": (KIMI_D, 40, KIMI_D.num_key_value_heads, KIMI_D.head_dim, KIMI_D.attention_factor),
}


@pytest.mark.parametrize("name", sorted(DRAFT_ROPES))
def test_rope_rotate_half(gpu, ops, name):
    from ddtree.plugins.layer_ops import RopeTable
    dcfg, q, n, hs, factor = DRAFT_ROPES[name]
    d = dcfg.head_dim
    rng = np.random.default_rng(q * n)
    x = f32_to_bf16(rng.uniform(-1, 1, (q, n, hs)))
    table = RopeTable.rotate_half(gpu, dcfg.rope, d, factor, MAX_POS)
    pos = positions(q, rng)
    xd = gpu.upload(x)
    ops.rope_rotate_half(xd, gpu.upload(pos), table, q, n, token_stride=n * hs, head_stride=hs)
    y = xd.numpy()
    ref = reference.rope_rotate_half(x[..., :d], pos, rope_frequencies(dcfg.rope, d), factor)
    a = np.abs(bf16_to_f32(x[..., :d]))
    pair = np.concatenate([a[..., : d // 2] + a[..., d // 2:]] * 2, axis=-1)
    assert_bf16(y[..., :d], ref, atol=1e-6 * factor * pair, what=name)
    assert np.abs(bf16_to_f32(y[..., :d]) - ref).max() <= 1e-2 * factor
    np.testing.assert_array_equal(y[..., d:], x[..., d:])
    dense = poisoned(gpu, (q, n, d))                                  # out of place from the padded heads
    ops.rope_rotate_half(dense, gpu.upload(pos), table, q, n, src=gpu.upload(x), src_token_stride=n * hs,
                         src_head_stride=hs)
    np.testing.assert_array_equal(dense.numpy(), y[..., :d])


def test_rope_position_outside_the_table_is_nan(gpu, ops):
    from ddtree.plugins.layer_ops import RopeTable
    table = RopeTable.interleaved(gpu, TINY_T.rope, 16, 64)
    x = f32_to_bf16(np.ones((3, 2, 16)))
    xd = gpu.upload(x)
    ops.rope_interleaved(xd, gpu.upload(np.array([5, 64, -1], np.int32)), table, 3, 2)
    y = bf16_to_f32(xd.numpy())
    assert np.isfinite(y[0]).all() and np.isnan(y[1:]).all()


# ---- silu * up, gather, cast ------------------------------------------------------------------------------

@pytest.mark.parametrize("m, I", [(5, TINY_T.intermediate_size), (16, KIMI_T.intermediate_size // 8),
                                  (3, KIMI_T.moe_intermediate_size), (1, 2)])
def test_silu_mul(gpu, ops, m, I):
    rng = np.random.default_rng(I + m)
    gu = bits(rng, (m, 2 * I), 4.0)
    out = poisoned(gpu, (m, I))
    ops.silu_mul(gpu.upload(gu), out, m, I)
    assert_bf16(out.numpy(), reference.silu_mul(gu), what=f"silu_mul {m}x{I}")


def test_gather_rows(gpu, ops):
    rng = np.random.default_rng(3)
    H, n = KIMI_T.hidden_size, 40
    src = bits(rng, (n, H + 64))                                     # rows H + 64 apart: a wider buffer
    rows = np.array([3, 0, 39, -1, 40, 17, 17], np.int32)
    out = poisoned(gpu, (len(rows), H))
    ops.gather_rows(gpu.upload(src), gpu.upload(rows), out, len(rows), H, n, src_stride=H + 64)
    np.testing.assert_array_equal(out.numpy(), reference.gather_rows(src[:, :H], rows))
    logits = rng.standard_normal((n, 64)).astype(np.float32)         # 4-byte elements
    out32 = poisoned(gpu, (len(rows), 64), np.float32)
    ops.gather_rows(gpu.upload(logits), gpu.upload(rows), out32, len(rows), 64, n, itemsize=4)
    np.testing.assert_array_equal(out32.numpy().view(np.uint32), reference.gather_rows(logits, rows).view(np.uint32))


@pytest.mark.parametrize("src_stride", [None, 256])
def test_rows_at_writes_rows_after_the_device_length(gpu, ops, src_stride):
    """dst rows T .. T + n - 1 = src's n rows (src_stride: a column slice, the drafter's ctx_v of k | v), the rows
    past dst_rows skipped; every other dst row untouched."""
    rng = np.random.default_rng(5)
    W, n, dst_rows, T = 128, 5, 12, 9
    stride = src_stride or W
    src, dst = bits(rng, (n, stride)), bits(rng, (dst_rows, W))
    d = gpu.upload(dst)
    ops.rows_at(d, dst_rows, gpu.upload(np.array([T], np.int32)), gpu.upload(src).view(stride - W, (n * stride,)),
                n, W, src_stride=src_stride)
    want = dst.copy()
    want[T:] = src[: dst_rows - T, stride - W:]
    np.testing.assert_array_equal(d.numpy(), want)


def test_cast_f32_bf16(gpu, ops):
    rng = np.random.default_rng(4)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, -3e-39, 3.4e38, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8,
                        np.float32(1.0 + 2.0 ** -8 + 2.0 ** -20)], np.float32)
    x = np.concatenate([special, (rng.standard_normal(100003) * 10.0 ** rng.integers(-30, 30, 100003)).astype(np.float32),
                        [np.nan]]).astype(np.float32)
    out = poisoned(gpu, len(x))
    ops.cast_f32_bf16(gpu.upload(x), out, len(x))
    y = out.numpy()
    np.testing.assert_array_equal(y[:-1], f32_to_bf16(x[:-1]))       # ties to even included
    assert np.isnan(bf16_to_f32(y[-1:])).all()


# ---- one graph, every step -----------------------------------------------------------------------------

def test_graph_replays_with_new_positions_and_rows(gpu, ops):
    """Captured once; positions, ids and rows change in their device buffers between replays."""
    from ddtree.plugins.layer_ops import RopeTable
    rng = np.random.default_rng(5)
    q, n, d, H, V = 4, 8, 64, 128, 256
    table = RopeTable.interleaved(gpu, KIMI_T.rope, d, MAX_POS)
    emb, w = bits(rng, (V, H)), bits(rng, H, 0.5)
    x0 = f32_to_bf16(rng.uniform(-1, 1, (q, n, d)))
    ids_d, pos_d, rows_d = gpu.zeros(q, np.int32), gpu.zeros(q, np.int32), gpu.zeros(2, np.int32)
    emb_d, w_d, x_d = gpu.upload(emb), gpu.upload(w), gpu.upload(x0)
    h, normed, taps = gpu.alloc((q, H), np.uint16), gpu.alloc((q, H), np.uint16), gpu.alloc((2, H), np.uint16)

    def step(s):
        ops.embed(ids_d, emb_d, h, q, H, 0, V, stream=s)
        ops.rms_norm(h, w_d, normed, q, H, 1e-6, stream=s)
        ops.gather_rows(normed, rows_d, taps, 2, H, q, stream=s)
        ops.rope_interleaved(x_d, pos_d, table, q, n, stream=s)

    step(gpu.stream)                                                 # warm-up: modules load outside capture
    graph = gpu.capture(step)
    for _ in range(3):
        ids, rows = rng.integers(0, V, q).astype(np.int32), rng.integers(0, q, 2).astype(np.int32)
        pos = np.append(rng.integers(0, MAX_POS, q - 1), MAX_POS - 1).astype(np.int32)
        for dst, src in ((ids_d, ids), (pos_d, pos), (rows_d, rows), (x_d, x0)):
            gpu.copy_in(dst, src)
        gpu.replay(graph)
        ref_norm = reference.rms_norm(emb[ids], w, 1e-6)
        assert_bf16(taps.numpy(), ref_norm[rows], what="graph taps")
        ref_rope = reference.rope_interleaved(x0, pos, rope_frequencies(KIMI_T.rope, d), rope_magnitude(KIMI_T.rope))
        assert np.abs(bf16_to_f32(x_d.numpy()) - ref_rope).max() <= 1e-2
