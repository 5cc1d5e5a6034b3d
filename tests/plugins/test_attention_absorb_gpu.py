"""GPU tests of the attention's split merge and absorb_out as one launch (kernels/mla_attention_absorb.cu via
plugins/mla_absorb.py MlaAbsorb.merged): against its float64 twin (plugins/reference.py mla_merge_absorb) from given
partials, and against the two launches it replaces (mla_attention_combine, then absorb_out) after the real split
kernels of both attention forms.

Tolerance, argued: the kernel merges S partials in fp32 (relative error ~S 2^-24 on the merged o_lat, against the
twin's float64), rounds o_lat to bf16, sums R products in fp32 (<= 2^-23 R sum |x w|) and rounds once to bf16
(<= 2^-8 |y|). Where the fp32 and float64 merges straddle a bf16 rounding boundary an input differs by one bf16 ulp
(<= 2^-7 |x_k|): rare (probability ~S 2^-16 an element), so each output may carry up to four such inputs, 4 x 2^-7
max_k |x_k w_k|. A dropped, doubled or misweighted split, a wrong head, token or span moves an output by O(|y| / S)
or more: far above it at the S used here. Outputs are poisoned with NaN first, so an unwritten element fails.
"""
import numpy as np
import pytest

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.plugins import reference as twins

pytestmark = pytest.mark.gpu
# (heads N_r, Dn, Dv, R): tiny (one-block clusters), Kimi at tp 8 (clusters of 8 spans of 64), a latent of 96 (three
# spans of 32), 16 heads of Dv 64 (4 of 8 warps multiply)
DIMS = [(4, 32, 32, 64), (8, 128, 128, 512), (2, 32, 48, 96), (16, 128, 64, 512)]


def nan_buffer(gpu, shape):
    a = gpu.alloc(shape, np.uint16)
    gpu.memset(a, 0xFF)                       # bf16 0xFFFF is NaN
    return a


def merged_x(part_o, part_lse, M):
    """The twin's merged o_lat [M N, R] before rounding, float64 (for the bound)."""
    lse = np.asarray(part_lse, np.float64)
    top = lse.max(axis=0)
    w = np.exp2(lse - np.where(np.isneginf(top), 0.0, top))
    den = w.sum(axis=0)
    return np.einsum("sr,srd->rd", w, part_o.astype(np.float64)) / np.where(den > 0, den, np.inf)[:, None]


def bound(x, kv_b, M, N, Dn, Dv, R):
    """Per output [M, N Dv]: 2^-23 R sum_k |x_k w_k| + 4 2^-7 max_k |x_k w_k| (the 2^-8 |y| is added by check)."""
    w_uv = np.abs(bf16_to_f32(kv_b).astype(np.float64).reshape(N, Dn + Dv, R)[:, Dn:])      # [N, Dv, R]
    ax = np.abs(x).reshape(M, N, 1, R)
    prod = ax * w_uv[None]                                                                  # [M, N, Dv, R]
    return (2.0 ** -23 * R * prod.sum(-1) + 4 * 2.0 ** -7 * prod.max(-1)).reshape(M, N * Dv)


def check(got_bits, ref, tol, what):
    got = bf16_to_f32(got_bits).astype(np.float64)
    assert np.isfinite(got).all(), f"{what}: unwritten or non-finite output"
    excess = np.abs(got - ref) - (2.0 ** -8 * np.abs(ref) + tol)
    at = np.unravel_index(excess.argmax(), ref.shape)
    assert excess.max() <= 0, f"{what}: element {at} off by {np.abs(got - ref)[at]:.3e} (ref {ref[at]:.3e}, " \
                              f"allowed {2.0 ** -8 * np.abs(ref[at]) + tol[at]:.3e})"


@pytest.mark.parametrize("splits", (2, 7, 67))
@pytest.mark.parametrize("M", (1, 9, 17, 33))
@pytest.mark.parametrize("dims", DIMS, ids=[f"n{d[0]}_dv{d[2]}_r{d[3]}" for d in DIMS])
def test_merged_matches_the_twin(gpu, dims, M, splits):
    """Given partials with empty splits (lse -inf, zero outputs: what the split kernels write for a split past the
    keys) and one row with every split empty (its output 0), merged as the twin merges them."""
    from ddtree.plugins.mla_absorb import MlaAbsorb
    N, Dn, Dv, R = dims
    rng = np.random.default_rng(hash((dims, M, splits)) % 2**32)
    kv_b = f32_to_bf16((rng.standard_normal((N * (Dn + Dv), R)) * R ** -0.5).astype(np.float32))
    rows = M * N
    part_o = rng.standard_normal((splits, rows, R)).astype(np.float32)
    part_lse = (rng.standard_normal((splits, rows)) * 3).astype(np.float32)      # weights over ~2^-9 .. 2^9
    empty = rng.random((splits, rows)) < 0.2
    empty[:, rows // 2] = True                                                    # a row with no key at all
    part_lse[empty], part_o[empty] = -np.inf, 0.0
    absorb = MlaAbsorb(gpu, N, Dn, Dv, R)
    plan = absorb.merged_plan(M, splits)
    if plan is None:
        pytest.skip(f"no merged plan at M {M}, {splits} splits (more merge weights a block than it holds)")
    o = nan_buffer(gpu, (M, N * Dv))
    absorb.merged(gpu.upload(part_o), gpu.upload(part_lse), splits, gpu.upload(kv_b), o, M)
    ref = twins.mla_merge_absorb(part_o, part_lse, kv_b, M, Dn, Dv)
    check(o.numpy(), ref, bound(merged_x(part_o, part_lse, M), kv_b, M, N, Dn, Dv, R),
          f"merged {dims} M={M} splits={splits} plan {plan}")
    assert not np.any(bf16_to_f32(o.numpy()).reshape(M, N, Dv)[(rows // 2) // N, (rows // 2) % N]), \
        "a row whose splits are all empty must come out 0"


@pytest.mark.parametrize("q,form,splits", [(1, "decode", 16), (1, "decode", 66), (2, "decode", 33),
                                           (9, "tree", 34), (17, "tree", 26)])
def test_merged_after_the_split_kernel_is_combine_then_absorb(gpu, q, form, splits):
    """Kimi at tp 8, 4096 keys and a tree of q: the split kernel's own partials, merged by the one launch, against
    mla_attention_combine then absorb_out on the same partials (the path it replaces), and against the float64
    attention twin then absorb_out (both paths within the attention tests' 2e-2 of it, norm-relative)."""
    import attention_cases as ac
    from test_mla_attention_gpu import Setup

    from ddtree.plugins.mla_absorb import MlaAbsorb
    N, Dn, Dv, R = 8, 128, 128, 512
    s = Setup(gpu, 4096, q, N)
    p = s.attn.override(q, 4096, form=form, splits=splits)
    rng = np.random.default_rng(q * 1000 + splits)
    kv_b = f32_to_bf16((rng.standard_normal((N * (Dn + Dv), R)) * R ** -0.5).astype(np.float32))
    kv_b_dev, absorb = gpu.upload(kv_b), MlaAbsorb(gpu, N, Dn, Dv, R)
    assert absorb.merged_plan(q, p.splits) is not None, f"the merged kernel must take Kimi's {p}"
    s.attn.launch_splits(p, s.q_lat, s.q_rope, s.cache.layer(0), s.vis, s.cache.lengths, q, 0)
    fused = nan_buffer(gpu, (q, N * Dv))
    absorb.merged(s.attn.part_o, s.attn.part_lse, p.splits, kv_b_dev, fused, q)
    o_lat = nan_buffer(gpu, (q, N, R))
    s.attn.launch_combine(p, q, o_lat)
    two = nan_buffer(gpu, (q, N * Dv))
    absorb.out(o_lat, kv_b_dev, two, q)
    gpu.sync()
    x = bf16_to_f32(o_lat.numpy()).astype(np.float64).reshape(q * N, R)
    two_f = bf16_to_f32(two.numpy()).astype(np.float64)
    check(fused.numpy(), two_f, 2.0 ** -8 * np.abs(two_f) + bound(x, kv_b, q, N, Dn, Dv, R),
          f"merged vs combine + absorb, q={q} {p}")
    ref_lat, _ = ac.reference(4096, q, N, s.case)                             # [q, N, R] (the attention tests')
    ref = twins.mla_absorb_out(np.asarray(ref_lat, np.float64), kv_b, Dn, Dv)
    for name, got in (("merged", bf16_to_f32(fused.numpy())), ("combine + absorb", two_f)):
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err <= 2e-2, f"{name} q={q} {p}: norm-relative error {err:.3e} against the float64 twins"


def test_merged_replays_in_a_graph_after_the_split_kernel(gpu):
    """The split kernel and the merged launch captured once (PDL between them), replayed after the queries change
    in place: the same bits as the launches run directly."""
    from test_mla_attention_gpu import Setup

    from ddtree.plugins.mla_absorb import MlaAbsorb
    N, Dn, Dv, R, q = 8, 128, 128, 512, 1
    s = Setup(gpu, 4096, q, N)
    p = s.attn.checked_plan(q, 4096)
    assert p.splits > 1
    kv_b = gpu.upload(f32_to_bf16((np.random.default_rng(3).standard_normal((N * (Dn + Dv), R)) * R ** -0.5)
                                  .astype(np.float32)))
    absorb = MlaAbsorb(gpu, N, Dn, Dv, R)
    out = nan_buffer(gpu, (q, N * Dv))

    def step(stream=None):
        s.attn.launch_splits(p, s.q_lat, s.q_rope, s.cache.layer(0), s.vis, s.cache.lengths, q, 0, stream=stream)
        absorb.merged(s.attn.part_o, s.attn.part_lse, p.splits, kv_b, out, q, stream=stream)

    graph = gpu.capture(step)
    for seed in (1, 2):
        q_lat = f32_to_bf16((np.random.default_rng(seed).standard_normal((q, N, R)) * 0.25).astype(np.float32))
        gpu.copy_in(s.q_lat, q_lat)
        gpu.replay(graph)
        gpu.sync()
        replayed = out.numpy().copy()
        gpu.memset(out, 0xFF)
        step()
        gpu.sync()
        assert np.array_equal(replayed, out.numpy()), f"seed {seed}: the replay differs from the direct launches"
