"""CPU tests of the tree_qreg attention variant (kernels/mla_tree_qreg.cuh): its cubin compiles for
sm_90 and sm_120 at every preset's latent dims with every kernel the launcher names and no more than a few
bytes of spills (ptxas's resource report through NVRTC), its shared memory is the struct's arithmetic, the
sm_120 plans fit 99 KB, and the default plans take it only where it measured faster on the H200. GPU
correctness: test_mla_attention_gpu.py test_every_qreg_variant_and_split_layout."""
import re

import attention_cases as ac
import pytest

from ddtree.plugins.mla_attention import (
    QREG_DEFINES,
    QREG_VARIANTS,
    AttentionPlan,
    compiled_at,
    plan_attention,
    smem_bytes,
)

SM120 = dict(sm_count=188, smem_limit=101376)
H200 = dict(sm_count=132, smem_limit=232448)


def kernel_name(form, warps, stages, row_groups) -> str:
    return AttentionPlan(form, warps, stages, row_groups, 1, 1, False, 0).kernel


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
@pytest.mark.parametrize("latent,rope", ac.DIMS, ids=[f"l{a}_r{b}" for a, b in ac.DIMS])
def test_qreg_kernels_compile_without_real_spills(arch, latent, rope):
    """Every variant compiled at these dims is in the cubin and nothing else of the tree form (the plain
    variants stay in the measured cubin); 4-warp groups do not spill; 2-warp groups hold 72 query registers
    beside 128 accumulators at Kimi's dims (255 registers) and spill at most 16 bytes."""
    report = ac.ptxas_report(arch, QREG_DEFINES, latent, rope)
    want = {kernel_name(*v) for v in QREG_VARIANTS if compiled_at(*v, latent)}
    assert want <= set(report), sorted(want - set(report))
    assert not [k for k in report if re.fullmatch(r"mla_attention_p\d_s\d", k)]
    for v in QREG_VARIANTS:
        if compiled_at(*v, latent):
            regs, spills = report[kernel_name(*v)]
            group = v[1] // (v[3] // 2)
            assert regs <= 255 and spills <= (0 if group == 4 else 16), (v, arch, regs, spills)


def test_qreg_shared_memory_is_the_struct_and_fits_sm120():
    """MlaQregSmem by hand at Kimi's dims (row 584): no query tile, so 2 slots with 8 warps fit sm_120."""
    row = 584 * 2
    assert smem_bytes("tree_qreg", 2, 2, 2, 512, 64) == 2 * 32 * row + 16 * 80 + 2 * 16 * 160 + 2 * 64 + 16
    assert smem_bytes("tree_qreg", 8, 2, 4, 512, 64) == 2 * 32 * row + 2 * 16 * 80 + 8 * 16 * 160 + 8 * 64 + 16
    assert smem_bytes("tree_qreg", 8, 2, 4, 512, 64) <= SM120["smem_limit"]
    assert smem_bytes("tree", 4, 2, 4, 512, 64) > SM120["smem_limit"]       # the plain 4-warp tree does not fit
    p = plan_attention(17, 8, 4096, **SM120, latent=512, rope=64, form="tree_qreg", warps=8)
    assert (p.warps, p.stages, p.row_groups) == (8, 2, 4) and p.smem <= SM120["smem_limit"]


def test_qreg_is_the_default_only_where_it_measured_faster():
    """H200, 8 heads: the default plans at the four measured shapes are the forced plans that beat the tree form
    there (qreg_default's table); elsewhere, on sm_120, at latent 96 and under forced knobs the tree form stays."""
    measured = {(4096, 8): (4, 3, 2, 32), (4096, 17): (4, 2, 2, 26), (32768, 8): (4, 2, 4, 128),
                (32768, 17): (4, 2, 4, 49)}
    for (T, q), (warps, stages, row_groups, P) in measured.items():
        p = plan_attention(q, 8, T, **H200, latent=512, rope=64)
        assert (p.form, p.warps, p.stages, p.row_groups, p.prefix_splits) == ("tree_qreg", warps, stages, row_groups, P)
    for T, q in ((100, 17), (131072, 17), (4096, 33), (32768, 4)):
        assert plan_attention(q, 8, T, **H200, latent=512, rope=64).form != "tree_qreg", (T, q)
    assert plan_attention(17, 8, 4096, **SM120, latent=512, rope=64).form == "tree"
    assert plan_attention(17, 8, 4096, **H200, latent=96, rope=32).form == "tree"
    assert plan_attention(17, 8, 4096, **H200, latent=512, rope=64, warps=2).form == "tree"


def test_qreg_forced_and_refused_where_not_compiled():
    p = plan_attention(17, 8, 4096, **H200, latent=512, rope=64, form="tree_qreg")
    assert p.kernel.startswith("mla_attention_qreg_") and p.extra_defines == QREG_DEFINES
    with pytest.raises(ValueError, match="not compiled"):               # 4-warp groups need latent % 64 == 0
        plan_attention(17, 8, 4096, **H200, latent=96, rope=32, form="tree_qreg", warps=4, row_groups=2, stages=2)
