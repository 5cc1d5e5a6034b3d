"""CPU tests of the tree_wgmma attention form (kernels/mla_tree_wgmma.cuh, sm_90a's warpgroup MMA): its cubin
compiles for sm_90a at Kimi's latent dims with every kernel the launcher names and no spills (ptxas's report
through NVRTC), the plain cubins do not carry it, its shared memory is the struct's arithmetic and fits the H200,
the plans take it only when forced or where it measured faster (wgmma_default), and other latents, sm_120 and
non-sm_90 GPUs are refused by name.
GPU correctness: test_mla_wgmma_gpu.py."""
import attention_cases as ac
import pytest

from ddtree.plugins.mla_attention import (
    WGMMA_ARCH,
    WGMMA_DEFINES,
    WGMMA_KEYS,
    WGMMA_VARIANTS,
    AttentionPlan,
    MlaTreeAttention,
    compiled_at,
    plan_attention,
    smem_bytes,
    wgmma_default,
)

H200 = dict(sm_count=132, smem_limit=232448)


def kernel_name(v) -> str:
    return AttentionPlan(*v, 1, 1, False, 0).kernel


def test_wgmma_kernels_compile_for_sm90a_without_spills():
    report = ac.ptxas_report(WGMMA_ARCH, WGMMA_DEFINES)
    want = {kernel_name(v) for v in WGMMA_VARIANTS}
    assert want | {"mla_attention_wgmma_smem_sizes", "mla_attention_combine"} == set(report), sorted(report)
    for v in WGMMA_VARIANTS:
        regs, spills = report[kernel_name(v)]
        assert regs <= 255 and spills == 0, (v, regs, spills)


def test_plain_cubins_do_not_carry_the_wgmma_form():
    """wgmma is not in sm_90 (without a) or sm_120: the plain cubin (what the builder ships) has none of it."""
    report = ac.ptxas_report("sm_120", {})
    assert not [k for k in report if "wgmma" in k]


def test_wgmma_shared_memory_is_the_struct_and_fits_the_h200():
    dk = 576 * 2
    for v in WGMMA_VARIANTS:
        keys = WGMMA_KEYS[v[2]]
        assert smem_bytes(*v, 512, 64) == 64 * dk + v[2] * keys * dk + 64 * keys * 2 + 512 + 1024
        assert smem_bytes(*v, 512, 64) <= H200["smem_limit"]


def test_wgmma_only_when_forced_and_only_where_compiled():
    for T, q in ((4096, 17), (32768, 17), (4096, 33), (131072, 65)):
        assert plan_attention(q, 8, T, **H200, latent=512, rope=64).form != "tree_wgmma"
    p = plan_attention(17, 8, 4096, **H200, latent=512, rope=64, form="tree_wgmma", stages=2, splits=8)
    assert (p.kernel, p.row_tiles, p.splits, p.arch, p.extra_defines) == \
        ("mla_attention_wgmma_k64_s2", 3, 9, "sm_90a", WGMMA_DEFINES)
    assert not compiled_at("tree_wgmma", 8, 2, 8, 96, 32) and not compiled_at("tree_wgmma", 8, 2, 8, 512, 48)
    with pytest.raises(ValueError, match="not compiled|no compiled"):
        plan_attention(17, 8, 4096, **H200, latent=96, rope=32, form="tree_wgmma")


class _FakeGpu:
    arch, name, sm_count, smem_optin = "sm_120", "RTX PRO 6000", 188, 101376

    def alloc(self, n, dtype):
        return None


def test_wgmma_refused_off_sm90():
    attn = MlaTreeAttention.__new__(MlaTreeAttention)
    attn.gpu, attn.heads, attn.latent, attn.rope = _FakeGpu(), 8, 512, 64
    with pytest.raises(ValueError, match="tree_wgmma needs an sm_90 GPU.*sm_120"):
        attn.override(17, 4096, form="tree_wgmma")


def _attention_on(arch: str) -> MlaTreeAttention:
    attn = MlaTreeAttention.__new__(MlaTreeAttention)
    gpu = _FakeGpu()
    gpu.arch, gpu.sm_count, gpu.smem_optin = arch, 132, 232448
    attn.gpu, attn.heads, attn.latent, attn.rope, attn._overrides = gpu, 8, 512, 64, {}
    return attn


def test_wgmma_is_the_default_only_where_it_measured_faster():
    """An sm_90 GPU plans 17 tokens x 8 heads from the 32768-key bucket and 33 / 65 tokens from 4096 with tree_wgmma,
    one wave of blocks (the measured plans: P 43, 26, 14 on 132 SMs); the measured-slower shapes, other GPUs and
    other latents keep the older forms."""
    for q, context, P in ((17, 32768, 43), (17, 32768 + 17, 43), (17, 131072, 43), (33, 4096, 26), (65, 4096, 14),
                          (65, 131072 + 65, 14)):
        p = _attention_on("sm_90").plan(q, context)
        assert (p.form, p.prefix_splits, p.tree_own, p.kernel) == ("tree_wgmma", P, True,
                                                                   "mla_attention_wgmma_k64_s2"), (q, context)
        assert p.row_tiles * p.splits <= 135
    for q, context in ((17, 4096), (8, 32768), (8, 4096), (17, 131072 + 257), (1, 32768), (256, 32768)):
        assert _attention_on("sm_90").plan(q, context).form != "tree_wgmma", (q, context)
    assert _attention_on("sm_120").plan(33, 32768).form != "tree_wgmma"
    assert wgmma_default(136, 32768, 96, 32, 132) is None and wgmma_default(136, 32768, 512, 64, 132) == 43

