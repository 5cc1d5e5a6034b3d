"""GPU tests of the tree_wgmma attention form (kernels/mla_tree_wgmma.cuh; sm_90 GPUs only, compiled for sm_90a)
against the fp32 numpy reference, as test_mla_attention_gpu.py checks the other forms: every compiled variant
with one split, three, and 200 (empty splits dropping out of the merge), at 8 and 64 heads, short and long
contexts, the tree in its own split and at the end of the last one; and the launcher's shared memory against
the kernel's struct."""
import attention_cases as ac
import numpy as np
import pytest
from test_mla_attention_gpu import Setup, check_attention

pytestmark = pytest.mark.gpu


@pytest.fixture
def sm90(gpu):
    if gpu.arch != "sm_90":
        pytest.skip(f"tree_wgmma needs an sm_90 GPU (wgmma), this is {gpu.arch}")
    return gpu


def test_launcher_smem_size_is_the_wgmma_struct(sm90):
    from ddtree.plugins.compile import latent_defines
    from ddtree.plugins.device import ptr
    from ddtree.plugins.mla_attention import SOURCE, WGMMA_ARCH, WGMMA_DEFINES, WGMMA_VARIANTS, smem_bytes
    sizes = sm90.zeros(len(WGMMA_VARIANTS), np.int32)
    kernel = sm90.kernel(SOURCE, "mla_attention_wgmma_smem_sizes", {**latent_defines(512, 64), **WGMMA_DEFINES},
                         arch=WGMMA_ARCH)
    sm90.launch(kernel, 1, 1, 0, ptr(sizes))
    assert sizes.numpy().tolist() == [smem_bytes(*v, 512, 64) for v in WGMMA_VARIANTS]


@pytest.mark.parametrize("T,q,heads", [(1, 8, 8), (100, 65, 8), (4096, 1, 8), (4096, 33, 8), (65536, 8, 8),
                                       (65536, 33, 8), (4096, 33, 64), (100, 65, 64)])
def test_every_wgmma_variant_and_split_layout(sm90, T, q, heads):
    from ddtree.plugins.mla_attention import WGMMA_VARIANTS
    s = Setup(sm90, T, q, heads)
    ref_out, ref_lse = ac.reference(T, q, heads, s.case)
    for form, warps, stages, row_groups in WGMMA_VARIANTS:
        for splits in (1, 3, 200):
            out, lse, plan = s.run(form=form, warps=warps, stages=stages, row_groups=row_groups, splits=splits)
            check_attention(out, lse, ref_out, ref_lse, f"T={T} q={q} H={heads} {plan}")


def test_default_plan_at_32768_keys_is_wgmma_and_matches_reference(sm90):
    """The shape where tree_wgmma is the default (17 tokens x 8 heads at the 32768-key bucket) through run()'s own
    plan, at T = 32768 and at a shorter T read on the device."""
    for T in (32768, 5000):
        s = Setup(sm90, T, 17, 8, max_context=32768)
        out, lse, plan = s.run(context_hint=32768)
        assert plan.form == "tree_wgmma" and plan.prefix_splits == 43
        ref_out, ref_lse = ac.reference(T, 17, 8, s.case)
        check_attention(out, lse, ref_out, ref_lse, f"T={T} q=17 default {plan}")
