"""GPU tests of the tree-masked MLA attention and the device KV cache against numpy references.

Attention: every case of attention_cases.CASES (Kimi's latent 512 / rope 64: contexts {1, 100, 4096, 65536}
x q {1, 8, 33, 65, 256} at 8 heads, and 64-head cases) and of DIM_CASES (every other preset's dims and a
synthetic (96, 32), kernels compiled for them) against the fp32 reference at the same dims: norm-relative error <= 1e-2 over the whole output
and <= 2e-2 for every query row (a single wrong row must not hide in the norm), lse within 2e-2 nats.
Outputs are poisoned with NaN before each run, so an unwritten element fails. The appended tree entries go
through DeviceLatentCache.append, so the append is exercised by every attention case. The cache tests,
the kernels' sizeof checks and the variant sweep run at every dims of attention_cases.DIMS.
"""
import attention_cases as ac
import numpy as np
import pytest

from ddtree.model.bf16 import bf16_to_f32
from ddtree.plugins import randfill

pytestmark = pytest.mark.gpu
DIMS_IDS = [f"l{latent}_r{rope}" for latent, rope in ac.DIMS]


def nan_fill(gpu, shape, dtype):
    a = gpu.alloc(shape, dtype)
    gpu.memset(a, 0xFF)                       # bf16 0xFFFF and fp32 0xFFFFFFFF are NaN
    return a


class Setup:
    """One case on the device: cache (prefix stream + appended tree), queries, vis, outputs."""

    def __init__(self, gpu, T, q, heads, latent=512, rope=64, max_context=None):
        from ddtree.plugins.kv_cache import DeviceLatentCache
        from ddtree.plugins.mla_attention import MlaTreeAttention
        self.T, self.q, self.heads, self.latent = T, q, heads, latent
        self.case = ac.inputs(T, q, heads, latent, rope)
        shape, stream = ac.prefix_spec(T, q, ac.case_seed(T, q, heads), latent + rope)
        self.cache = DeviceLatentCache(gpu, layers=1, capacity=shape[0] + 7, latent=latent, rope=rope)
        randfill.fill_device(gpu, self.cache.layer(0).view(0, shape), stream, randfill.ACT_BF16)
        self.cache.set_length(T)
        row = latent + rope + 8
        kv_new = gpu.upload(np.concatenate([self.case["c_kv"], self.case["k_pe"],
                                            np.zeros((q, 8), np.uint16)], axis=1))      # [q, row]: strided rows
        self.cache.append(0, kv_new, kv_new.ptr + latent * 2, q, c_stride=row, k_stride=row)
        self.q_lat, self.q_rope = gpu.upload(self.case["q_lat"]), gpu.upload(self.case["q_rope"])
        self.vis = gpu.upload(self.case["vis"])
        self.attn = MlaTreeAttention(gpu, heads, ac.SCALE, latent=latent, rope=rope, max_q=max(q, 1),
                                     max_context=max(T, 1) if max_context is None else max_context)
        self.gpu = gpu

    def run(self, context_hint=None, **forced):
        if forced:
            self.attn.override(self.q, self.T if context_hint is None else context_hint, **forced)
        out = nan_fill(self.gpu, (self.q, self.heads, self.latent), np.uint16)
        lse = nan_fill(self.gpu, (self.q, self.heads), np.float32)
        plan = self.attn.run(self.q_lat, self.q_rope, self.cache.layer(0), self.vis, self.cache.lengths, self.q,
                             out, lse, context_hint=self.T if context_hint is None else context_hint)
        return bf16_to_f32(out.numpy()), lse.numpy(), plan


def check_attention(out, lse, ref_out, ref_lse, what):
    assert np.isfinite(out).all() and np.isfinite(lse).all(), f"{what}: unwritten or non-finite output"
    ref_out = ref_out.astype(np.float64)
    err = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
    rows = (out - ref_out).reshape(-1, out.shape[-1])
    row_err = np.linalg.norm(rows, axis=1) / np.linalg.norm(ref_out.reshape(rows.shape), axis=1)
    assert err <= 1e-2, f"{what}: norm-relative error {err:.3e}"
    assert row_err.max() <= 2e-2, f"{what}: row {row_err.argmax()} (token {row_err.argmax() // out.shape[1]}) " \
                                  f"off by {row_err.max():.3e}"
    assert np.abs(lse - ref_lse).max() <= 2e-2, f"{what}: lse off by {np.abs(lse - ref_lse).max():.3e}"
    return err


@pytest.mark.parametrize("T,q,heads", ac.CASES, ids=[ac.case_name(*c) for c in ac.CASES])
def test_attention_matches_reference(gpu, T, q, heads):
    s = Setup(gpu, T, q, heads)
    out, lse, plan = s.run()
    ref_out, ref_lse = ac.reference(T, q, heads, s.case)
    check_attention(out, lse, ref_out, ref_lse, f"T={T} q={q} H={heads} {plan}")


@pytest.mark.parametrize("T,q,heads,latent,rope", ac.DIM_CASES, ids=[ac.case_name(*c) for c in ac.DIM_CASES])
def test_attention_matches_reference_at_other_dims(gpu, T, q, heads, latent, rope):
    s = Setup(gpu, T, q, heads, latent, rope)
    out, lse, plan = s.run()
    ref_out, ref_lse = ac.reference(T, q, heads, s.case)
    check_attention(out, lse, ref_out, ref_lse, f"T={T} q={q} H={heads} latent={latent} rope={rope} {plan}")


def check_variants(gpu, T, q, heads, latent, rope, variants):
    from ddtree.plugins.mla_attention import compiled_at, smem_bytes
    s = Setup(gpu, T, q, heads, latent, rope)
    ref_out, ref_lse = ac.reference(T, q, heads, s.case)
    for form, warps, stages, row_groups in variants:
        if smem_bytes(form, warps, stages, row_groups, latent, rope) > gpu.smem_optin \
                or not compiled_at(form, warps, stages, row_groups, latent, rope):
            continue
        for splits in (1, 3, 200):
            out, lse, plan = s.run(form=form, warps=warps, stages=stages, row_groups=row_groups, splits=splits)
            check_attention(out, lse, ref_out, ref_lse, f"T={T} q={q} latent={latent} rope={rope} {plan}")


@pytest.mark.parametrize("latent,rope", ac.DIMS, ids=DIMS_IDS)
@pytest.mark.parametrize("T,q,heads", [(100, 65, 8), (4096, 33, 8), (4096, 1, 8)])
def test_every_variant_and_split_layout(gpu, T, q, heads, latent, rope):
    """Each compiled (form, warps, stages, row groups) but tree_qreg's and tree_wgmma's with the tree in its own split, merged into
    one split, and with more splits than the prefix has blocks (empty splits must drop out of the merge; 3 and
    200 splits take different combine shapes)."""
    from ddtree.plugins.mla_attention import QREG_VARIANTS, VARIANTS, WGMMA_VARIANTS
    check_variants(gpu, T, q, heads, latent, rope, [v for v in VARIANTS if v not in QREG_VARIANTS + WGMMA_VARIANTS])


@pytest.mark.parametrize("latent,rope", ac.DIMS, ids=DIMS_IDS)
@pytest.mark.parametrize("T,q,heads", [(100, 65, 8), (4096, 33, 8), (4096, 1, 8)])
def test_every_qreg_variant_and_split_layout(gpu, T, q, heads, latent, rope):
    """The same for the tree_qreg kernels (query fragments in registers; (64, 16): 5 k-steps over 2 or 4 warps,
    one warp of a 4-warp group with none; 4096 x 1: 8 valid rows of a 16-row group)."""
    from ddtree.plugins.mla_attention import QREG_VARIANTS
    check_variants(gpu, T, q, heads, latent, rope, QREG_VARIANTS)


def test_plan_for_a_longer_context_reads_T_on_the_device(gpu):
    """A graph planned for a 65536-key bucket serves T = 4096: the chunk per split follows lengths[0]."""
    s = Setup(gpu, 4096, 33, 8, max_context=65536)
    out, lse, plan = s.run(context_hint=65536)
    assert plan.prefix_splits > 4096 // 256
    ref_out, ref_lse = ac.reference(4096, 33, 8, s.case)
    check_attention(out, lse, ref_out, ref_lse, f"hint 65536, T 4096 {plan}")


@pytest.mark.parametrize("latent,rope", ac.DIMS, ids=DIMS_IDS)
def test_single_token_equals_the_tree_root_row(gpu, latent, rope):
    """The root (node 0) sees the prefix and itself only, so a q = 1 call over the same cache equals row 0
    of the tree call, up to bf16 rounding of two differently split sums."""
    s = Setup(gpu, 4096, 65, 8, latent, rope)
    tree_out, tree_lse, _ = s.run()
    from ddtree.plugins.mla_attention import MlaTreeAttention
    out = nan_fill(gpu, (1, 8, latent), np.uint16)
    lse = nan_fill(gpu, (1, 8), np.float32)
    attn = MlaTreeAttention(gpu, 8, ac.SCALE, latent=latent, rope=rope, max_q=1, max_context=4096)
    plan = attn.run(s.q_lat, s.q_rope, s.cache.layer(0), gpu.upload(np.ones((1, 1), np.uint32)),
                    s.cache.lengths, 1, out, lse, context_hint=4096)     # token 0's queries, root entry at T
    assert plan.form == "decode" and plan.splits > 1                   # another kernel and split than the tree call
    single = bf16_to_f32(out.numpy())[0]
    np.testing.assert_allclose(single, tree_out[0], rtol=1e-2, atol=1e-2 * np.abs(tree_out[0]).max())
    np.testing.assert_allclose(lse.numpy()[0], tree_lse[0], atol=1e-3)


@pytest.mark.parametrize("latent,rope", ac.DIMS, ids=DIMS_IDS)
def test_compaction_matches_reference_cache(gpu, latent, rope):
    """Random accepted paths (including keep = [1, 2, ..] where every source is another's destination)
    over 3 layers vs ddtree.reference.cache.LatentCache.compact, bit for bit."""
    from ddtree.plugins.kv_cache import DeviceLatentCache
    from ddtree.reference.cache import LatentCache
    layers, cap, T = 3, 700, 300
    rng = np.random.default_rng(7)
    cache = DeviceLatentCache(gpu, layers, cap, latent=latent, rope=rope)
    for keep in ([1, 2, 3], [0], list(range(1, 256)), sorted(rng.choice(256, 40, replace=False)),
                 [0, 2, 4, 6, 8, 10, 12], list(range(256)), [255]):
        keep = np.asarray(keep, dtype=np.int32)
        data = rng.integers(0, 1 << 16, size=(layers, cap, latent + rope), dtype=np.uint16)
        gpu.copy_in(cache.buf, data)
        cache.set_length(T)
        ref = LatentCache(layers, latent, rope, dtype=np.uint16, capacity=cap)
        ref.set_length(T + 256)
        for layer in range(layers):
            ref.write(layer, 0, data[layer, :T + 256, :latent], data[layer, :T + 256, latent:])
        ref.truncate(T + 256)
        ref.compact(T, keep)
        cache.compact(gpu.upload(keep), len(keep))
        got = cache.buf.numpy()
        for layer in range(layers):
            np.testing.assert_array_equal(got[layer, : T + len(keep)], ref.entries(layer),
                                          err_msg=f"layer {layer}, keep {keep[:8]}..")
            np.testing.assert_array_equal(got[layer, T + len(keep):], data[layer, T + len(keep):])  # rest untouched


@pytest.mark.parametrize("latent,rope", ac.DIMS, ids=DIMS_IDS)
def test_append_writes_only_its_slots(gpu, latent, rope):
    """Dense rows, every element distinct (a swapped or shifted vector shows), into layer 1 only."""
    from ddtree.plugins.kv_cache import DeviceLatentCache
    dk = latent + rope
    cache = DeviceLatentCache(gpu, 2, 64, latent=latent, rope=rope)
    before = np.arange(2 * 64 * dk, dtype=np.uint32).astype(np.uint16).reshape(2, 64, dk)
    gpu.copy_in(cache.buf, before)
    cache.set_length(10)
    new = (np.arange(5 * dk, dtype=np.uint32) * 7 + 40000).astype(np.uint16).reshape(5, dk)
    cache.append(1, gpu.upload(new[:, :latent]), gpu.upload(new[:, latent:]), 5)
    want = before.copy()
    want[1, 10:15] = new
    np.testing.assert_array_equal(cache.buf.numpy(), want)


@pytest.mark.parametrize("latent,rope", ac.DIMS, ids=DIMS_IDS)
def test_launcher_smem_size_is_the_kernel_struct(gpu, latent, rope):
    from ddtree.plugins.compile import latent_defines
    from ddtree.plugins.device import ptr
    from ddtree.plugins.mla_attention import DECODE_SOURCE, QREG_DEFINES, SOURCE, VARIANTS, smem_bytes
    for form, source, name, extra in (("tree", SOURCE, "mla_attention_smem_sizes", {}),
                                      ("decode", DECODE_SOURCE, "mla_decode_smem_sizes", {}),
                                      ("tree_qreg", SOURCE, "mla_attention_qreg_smem_sizes", QREG_DEFINES)):
        variants = [v for v in VARIANTS if v[0] == form]
        sizes = gpu.zeros(len(variants), np.int32)
        kernel = gpu.kernel(source, name, {**latent_defines(latent, rope), **extra})
        gpu.launch(kernel, 1, 1, 0, ptr(sizes))
        assert sizes.numpy().tolist() == [smem_bytes(*v, latent, rope) for v in variants], form
