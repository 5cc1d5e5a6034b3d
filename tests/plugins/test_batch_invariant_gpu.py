"""The batch-invariant kernel plan (backends/cuda_backend.py KERNEL_PLANS), kernel by kernel: a row's output is
bitwise the same whatever rows share its call.

- Attention (plugins/mla_invariant.py): every node of a branching tree, verified in one call, against the
  one-token decode of that node (its ancestors moved to the prefix at their positions, q = 1): bitwise; and
  the fp32 twin (reference.mla_tree_attention) to the fast form's tolerance. Trees put split (256) and chunk
  (32) boundaries inside the ancestor chains.
- Skinny GEMM, absorb and MoE with invariant=True: the rows of an M-row call against the same rows one at a
  time, bitwise (and the GEMM against the numpy product, so "bitwise" is not two equal wrong answers).
"""
import numpy as np
import pytest

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.plugins import layout, reference
from ddtree.tree.build import Tree

pytestmark = pytest.mark.gpu
SCALE = 0.07


def bf16(rng, shape, std=1.0):
    return f32_to_bf16(rng.standard_normal(shape).astype(np.float32) * std)


def random_parents(rng, n):
    """A branching tree of n nodes, parents[i] < i, deep enough that the chain crosses chunk boundaries."""
    parents = [-1]
    for i in range(1, n):
        parents.append(i - 1 if rng.random() < 0.6 else int(rng.integers(0, i)))
    return np.array(parents, np.int32)


def attend(gpu, attn, q_lat, q_rope, cache, vis, T):
    q, H, DL = q_lat.shape
    out, lse = gpu.alloc((q, H, DL), np.uint16), gpu.alloc((q, H), np.float32)
    lengths = gpu.upload(np.array([T], np.int32))
    attn.run(gpu.upload(q_lat), gpu.upload(q_rope), gpu.upload(cache), gpu.upload(vis), lengths, q, out, lse)
    gpu.sync()
    return out.numpy(), lse.numpy()


@pytest.mark.parametrize("latent, rope, heads, T, q", [(512, 64, 8, 250, 40), (512, 64, 8, 1000, 17),
                                                      (64, 16, 4, 30, 65), (64, 16, 4, 500, 33)])
def test_invariant_attention_tree_rows_equal_decode_bitwise(gpu, latent, rope, heads, T, q):
    from ddtree.plugins.mla_invariant import MlaInvariantAttention
    rng = np.random.default_rng(T * 1000 + q)
    tree = Tree.from_parents(random_parents(rng, q))
    S = T + q + 8
    cache = bf16(rng, (S, latent + rope))
    q_lat, q_rope = bf16(rng, (q, heads, latent)), bf16(rng, (q, heads, rope))
    attn = MlaInvariantAttention(gpu, heads, SCALE, latent=latent, rope=rope, max_q=q, max_context=S)
    out, lse = attend(gpu, attn, q_lat, q_rope, cache, tree.visibility_bits(), T)

    want, want_lse = reference.mla_tree_attention(q_lat, q_rope, cache, T, tree.visibility_bits(), SCALE)
    got = bf16_to_f32(out)
    err = np.abs(got - want).max(axis=(1, 2)) / np.abs(want).max()
    assert err.max() < 2e-2, f"row error vs the fp32 twin {err.max():.3e}"
    assert np.abs(lse - want_lse).max() < 2e-2

    visible = tree.visible()
    for i in rng.permutation(q)[:12]:                  # the decode of node i: its chain in the prefix
        chain = np.flatnonzero(visible[i])            # ancestors then i, by depth (index order)
        dec_cache = np.zeros_like(cache)
        dec_cache[:T] = cache[:T]
        dec_cache[T:T + len(chain)] = cache[T + chain]
        d_out, d_lse = attend(gpu, attn, q_lat[i:i + 1], q_rope[i:i + 1], dec_cache, np.ones((1, 1), np.uint32),
                              T + len(chain) - 1)
        assert np.array_equal(d_out[0], out[i]), f"node {i} (depth {tree.depth[i]}): decode != verify"
        assert np.array_equal(d_lse[0], lse[i])


def test_invariant_gemm_rows_do_not_depend_on_the_batch(gpu):
    from ddtree.plugins.gemm import SkinnyGemm
    rng = np.random.default_rng(3)
    N, K, M = 1536, 7168, 65                                   # Kimi's q_a shape: the fast plan splits by M
    w, x = bf16(rng, (N, K), 0.02), bf16(rng, (M, K))
    wd, xd = gpu.upload(layout.tile_bf16(w)), gpu.upload(x)
    gemm = SkinnyGemm(gpu, N, K, 256, invariant=True)
    assert len({gemm.plan(m).splits for m in (1, 5, 17, 65, 256)}) == 1
    out = gpu.alloc((M, N), np.uint16)
    gemm.run(xd, wd, out, M)
    batch = out.numpy()
    want = bf16_to_f32(x) @ bf16_to_f32(w).T
    assert np.abs(bf16_to_f32(batch) - want).max() < 2e-2 * np.abs(want).max()
    one = gpu.alloc((1, N), np.uint16)
    for m in (0, 7, 16, 33, 64):
        gemm.run(xd.ptr + m * K * 2, wd, one, 1)
        gpu.sync()
        assert np.array_equal(one.numpy()[0], batch[m]), f"row {m}: M = 1 != M = {M}"


def test_invariant_absorb_rows_do_not_depend_on_the_batch(gpu):
    from ddtree.plugins.mla_absorb import MlaAbsorb, uk_transposed
    rng = np.random.default_rng(4)
    heads, nope, v, latent, M = 8, 128, 128, 512, 40
    kv_b = bf16(rng, (heads * (nope + v), latent), 0.05)
    q_nope, o_lat = bf16(rng, (M, heads, nope)), bf16(rng, (M, heads, latent))
    ab = MlaAbsorb(gpu, heads, nope, v, latent, invariant=True)
    w_uk, kv = gpu.upload(uk_transposed(kv_b, heads, nope, v)), gpu.upload(kv_b)
    qn, ol = gpu.upload(q_nope), gpu.upload(o_lat)
    q_lat, o = gpu.alloc((M, heads, latent), np.uint16), gpu.alloc((M, heads * v), np.uint16)
    ab.q(qn, w_uk, q_lat, M)
    ab.out(ol, kv, o, M)
    gpu.sync()
    q_all, o_all = q_lat.numpy(), o.numpy()
    one_q, one_o = gpu.alloc((1, heads, latent), np.uint16), gpu.alloc((1, heads * v), np.uint16)
    for m in (0, 9, 39):
        ab.q(qn.ptr + m * heads * nope * 2, w_uk, one_q, 1)
        ab.out(ol.ptr + m * heads * latent * 2, kv, one_o, 1)
        gpu.sync()
        assert np.array_equal(one_q.numpy()[0], q_all[m]) and np.array_equal(one_o.numpy()[0], o_all[m])


def test_invariant_moe_rows_do_not_depend_on_the_batch(gpu):
    from moe_cases import random_experts

    from ddtree.plugins.moe import FusedMoE, MoEShape
    rng = np.random.default_rng(5)
    H, I, E, k, M = 1024, 256, 16, 4, 33
    packed = layout.repack_experts(random_experts(rng, E, H, I, 0.05))
    router = bf16(rng, (E, H), 0.05)
    bias = (rng.standard_normal(E) * 0.1).astype(np.float32)
    moe = FusedMoE(gpu, MoEShape(H, I, E, k, scaling=2.5, max_tokens=64), {key: gpu.upload(v) for key, v in packed.items()},
                   router=gpu.upload(layout.tile_bf16(router)), bias=gpu.upload(bias), invariant=True)
    assert len({moe.plan(m).gu_splits for m in (1, 8, 33, 64)}) == 1
    x = bf16(rng, (M, H))
    xd, out = gpu.upload(x), gpu.alloc((M, H), np.uint16)
    moe.run(xd, out, M)
    gpu.sync()
    batch = out.numpy()
    one = gpu.alloc((1, H), np.uint16)
    for m in (0, 12, 32):
        moe.run(xd.ptr + m * H * 2, one, 1)
        gpu.sync()
        assert np.array_equal(one.numpy()[0], batch[m]), f"row {m}: M = 1 != M = {M}"
