"""CPU tests of the batch-invariant kernel plan (backends/cuda_backend.py KERNEL_PLANS): one split per kernel for
every row count, plans that fit both archs' shared memory, and the flag refused by name where it means nothing.
(Bitwise row independence is the GPU's to show: tests/plugins/test_batch_invariant_gpu.py.)"""
import numpy as np
import pytest
from click.testing import CliRunner
from test_plans import ARCHS, GEMM_SHAPES, MOE_SHAPES

from ddtree.plugins.moe_plan import DEFAULT_RING, plan_moe


class PlanGpu:
    """What the launchers' constructors read of a GPU: arch, SMs, shared memory, defines, allocations."""

    def __init__(self, arch):
        self.arch, self.sm_count, self.smem_optin = arch, ARCHS[arch]["sm_count"], ARCHS[arch]["smem_limit"]

    def defines(self, source):
        from ddtree.plugins.compile import defines_for
        return defines_for(source, self.arch)

    def alloc(self, shape, dtype):
        return np.empty(shape, dtype)

    zeros = alloc


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_invariant_gemm_plans_one_split_for_every_m(arch):
    from ddtree.plugins.gemm import SkinnyGemm
    gpu, moved = PlanGpu(arch), 0
    for N, K in GEMM_SHAPES:
        fast, inv = SkinnyGemm(gpu, N, K, 256), SkinnyGemm(gpu, N, K, 256, invariant=True)
        plans = [inv.plan(m) for m in range(1, 257)]
        assert len({p.splits for p in plans}) == 1, (N, K)
        assert all(p.smem <= gpu.smem_optin and p.mb * 8 * p.mt >= m for m, p in enumerate(plans, 1))
        moved += len({fast.plan(m).splits for m in range(1, 257)}) > 1
    assert moved, "no shape's fast plan varies its split with M: the invariant plan would change nothing"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_invariant_absorb_and_moe_plans_one_split_for_every_m(arch):
    from ddtree.plugins.mla_absorb import MlaAbsorb
    gpu = PlanGpu(arch)
    for heads in (8, 64):
        ab = MlaAbsorb(gpu, heads, 128, 128, 512, invariant=True)
        assert len({ab.plan_q(m).ks for m in range(1, 257)}) == 1
        assert len({ab.plan_out(m).ks for m in range(1, 257)}) == 1
    fast_out = MlaAbsorb(gpu, 8, 128, 128, 512)
    assert len({fast_out.plan_out(m).ks for m in range(1, 257)}) > 1
    ring = DEFAULT_RING.get(arch, DEFAULT_RING["default"])
    for shape in MOE_SHAPES.values():
        fixed = plan_moe(shape, 256, gpu.sm_count, gpu.smem_optin, ring).gu_splits
        for m in range(1, 257):
            p = plan_moe(shape, m, gpu.sm_count, gpu.smem_optin, ring, gu_splits=fixed)
            assert p.gu_splits == fixed and max(p.gu_smem, p.dn_smem) <= gpu.smem_optin


def test_unknown_kernel_plan_is_refused_by_name():
    from ddtree.backends.cuda_backend import CudaOps
    with pytest.raises(ValueError, match="kernel plan 'invariant'; choose from fast, batch-invariant"):
        CudaOps(None, None, None, kernel_plan="invariant")


def test_kernel_plan_flag_needs_the_gpu():
    from ddtree.bench.cli import bench
    from ddtree.runtime.run_cli import run_command
    out = CliRunner().invoke(bench, ["e2e", "--kernel-plan", "batch-invariant"])
    assert out.exit_code == 2 and "--kernel-plan" in out.output and "--device cpu" in out.output
    out = CliRunner().invoke(run_command, ["hi", "--kernel-plan", "batch-invariant", "--max-new-tokens", "2"])
    assert out.exit_code != 0 and "--kernel-plan batch-invariant is a plan of the GPU kernels" in out.output
