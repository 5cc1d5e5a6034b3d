"""GPU test of kv_append_normed (kernels/kv_cache.cu): the MLA's kv_a output normed, roped and appended in one
launch must write the bits of the three kernels it replaces (rms_norm_rows, rope_interleaved, kv_append), and
be within the layer-op error rule of the float64 twins (plugins/reference.py rms_norm, rope_interleaved; the rule
is derived in tests/plugins/test_layer_ops_gpu.py). Kimi's dims (R 512, Dr 64) and the tiny model's, a latent
inside a wider buffer (the row stride honoured), entries after a non-empty prefix, positions up to 262143 and
one outside the table (NaN in that entry's k_pe, as rope_interleaved writes)."""
import numpy as np
import pytest

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.model.presets import get_preset
from ddtree.model.rope import rope_frequencies, rope_magnitude
from ddtree.plugins import reference

pytestmark = pytest.mark.gpu
MAX_POS = 262144
EPS = 1e-6
CASES = {  # name: (target cfg, rows q, latent row stride (>= R + Dr), committed prefix)
    "kimi q17": (get_preset("kimi-k2.6", layers=2)[0], 17, 576, 40),
    "kimi q1 strided": (get_preset("kimi-k2.6", layers=2)[0], 1, 640, 0),
    "kimi q65 strided": (get_preset("kimi-k2.6", layers=2)[0], 65, 600, 7),
    "tiny q16": (get_preset("tiny")[0], 16, None, 3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kv_append_normed_is_the_three_kernels(gpu, name):
    from ddtree.plugins.compile import latent_defines
    from ddtree.plugins.device import ptr
    from ddtree.plugins.kv_cache import SOURCE, DeviceLatentCache, normed_append_threads
    from ddtree.plugins.layer_ops import LayerOps, RopeTable
    cfg, q, stride, prefix = CASES[name]
    R, Dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    stride = stride or R + Dr
    rng = np.random.default_rng(q * stride)
    latent = f32_to_bf16(rng.standard_normal((q, stride)) * 2.0)
    w = f32_to_bf16(rng.uniform(0.2, 1.5, R))
    pos = rng.integers(0, MAX_POS, q).astype(np.int32)
    pos[-1] = MAX_POS - 1
    if q > 2:
        pos[1] = MAX_POS                                         # outside the table: NaN pairs, never wrapped
    table = RopeTable.interleaved(gpu, cfg.rope, Dr, MAX_POS)
    x, wd, pd = gpu.upload(latent), gpu.upload(w), gpu.upload(pos)

    # the three kernels the layer ran before
    ops = LayerOps(gpu)
    three = DeviceLatentCache(gpu, 1, prefix + q + 4, latent=R, rope=Dr)
    gpu.memset(three.buf, 0xFF)
    three.set_length(prefix)
    c_kv, k_pe = gpu.alloc((q, R), np.uint16), gpu.alloc((q, Dr), np.uint16)
    ops.rms_norm(x, wd, c_kv, q, R, EPS, x_stride=stride)
    ops.rope_interleaved(k_pe, pd, table, q, 1, src=x.view(R, (q, stride - R)), src_token_stride=stride,
                         src_head_stride=Dr)
    three.append(0, c_kv, k_pe, q)

    # the one kernel
    one = DeviceLatentCache(gpu, 1, prefix + q + 4, latent=R, rope=Dr)
    gpu.memset(one.buf, 0xFF)
    one.set_length(prefix)
    gpu.launch(gpu.kernel(SOURCE, "kv_append_normed", latent_defines(R, Dr)), q, normed_append_threads(R, Dr), 0,
               ptr(one.layer(0)), ptr(one.lengths), ptr(x), np.int32(stride), ptr(wd), np.float32(EPS), ptr(pd),
               ptr(table.table), np.int32(table.max_pos))
    got, want = one.buf.numpy()[0], three.buf.numpy()[0]
    np.testing.assert_array_equal(got, want)                    # the same bits, NaN pairs included
    assert (got[:prefix] == 0xFFFF).all() and (got[prefix + q:] == 0xFFFF).all(), "wrote outside its rows"

    entries = got[prefix: prefix + q]
    assert_rule(entries[:, :R], reference.rms_norm(latent[:, :R], w, EPS), 0.0, f"{name} c_kv")
    ok = (pos >= 0) & (pos < MAX_POS)
    mag = rope_magnitude(cfg.rope)
    pe = latent[:, R: R + Dr].reshape(q, 1, Dr)
    ref = reference.rope_interleaved(pe[ok], pos[ok], rope_frequencies(cfg.rope, Dr), mag)[:, 0]
    pair = np.abs(bf16_to_f32(pe[ok, 0])).reshape(-1, Dr // 2, 2).sum(-1).repeat(2, axis=-1)
    assert_rule(entries[ok, R:], ref, 1e-6 * mag * pair, f"{name} k_pe")
    assert np.isnan(bf16_to_f32(entries[~ok, R:])).all(), "a position outside the table must give NaN"
    assert np.isfinite(bf16_to_f32(entries[~ok, :R])).all(), "c_kv does not depend on the position"


def assert_rule(y_bits, ref, atol, what):
    """|y - r| <= 2^-8 |r| + atol per element (tests/plugins/test_layer_ops_gpu.py derives it)."""
    y, ref = bf16_to_f32(np.asarray(y_bits)).astype(np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(y).all(), f"{what}: non-finite output"
    excess = np.abs(y - ref) - (2.0 ** -8 * np.abs(ref) + atol)
    assert excess.max() <= 0, f"{what}: off by {np.abs(y - ref).max():.3e}"
