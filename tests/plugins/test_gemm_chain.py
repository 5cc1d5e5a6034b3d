"""CPU tests of the persistent GEMM chain's plan and twin (plugins/gemm_chain.py; kernels/gemm_chain.cu compiles for
sm_90 and sm_120 in test_compile.py): every op's (tile, k-split) items land on exactly one warp, in op order, each
op's split divides its k chunks and the rings fit sm_120's 99 KB, bad chains are named, and the twin feeds each op
its source's bf16 output."""
import numpy as np
import pytest

from ddtree.bench.chain import KIMI_TP8_LAYER
from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.plugins import gemm_chain as gc

ARCHS = {"sm_90": (132, 232448), "sm_120": (188, 101376)}     # (SMs, shared memory a block) of H200 / PRO 6000


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_item_runs_once_and_fits(arch):
    blocks, smem = ARCHS[arch]
    warps, stages = gc.kernel_constants(arch)
    ops = list(KIMI_TP8_LAYER.values())
    plan = gc.plan_chain(ops, blocks, warps, stages, smem)
    assert plan.smem == warps * stages * 2048 <= smem
    per_warp = gc.warp_items(ops, plan, blocks * warps)
    seen = [item for items in per_warp for item in items]
    want = [(i, tile, s) for i, o in enumerate(ops) for tile in range(-(-o.N // 16)) for s in range(plan.splits[i])]
    assert sorted(seen) == sorted(want) and len(seen) == len(set(seen))
    for o, S in zip(ops, plan.splits):
        assert (o.K // 64) % S == 0
    # op order on every warp: a warp never holds an item of op i after one of op i + 1 (the no-cycle argument)
    for items in per_warp:
        assert [i for i, _, _ in items] == sorted(i for i, _, _ in items)


def test_bad_chains_are_named():
    with pytest.raises(ValueError, match="op 1: src 1"):
        gc.check_chain([gc.ChainGemm(64, 64, gc.INPUT), gc.ChainGemm(64, 64, 1)])
    with pytest.raises(ValueError, match="op 1: K = 128 exceeds op 0's N = 64"):
        gc.check_chain([gc.ChainGemm(64, 64, gc.INPUT), gc.ChainGemm(64, 128, 0)])
    with pytest.raises(ValueError, match="K % 64"):
        gc.check_chain([gc.ChainGemm(64, 96, gc.INPUT)])
    with pytest.raises(ValueError, match="M = 25 rows"):
        gc.token_tiles(25)


def test_twin_feeds_each_op_its_sources_bf16_output():
    rng = np.random.default_rng(0)
    ops = [gc.ChainGemm(96, 128, gc.INPUT), gc.ChainGemm(40, 64, 0), gc.ChainGemm(24, 128, gc.INPUT)]
    x = f32_to_bf16(rng.standard_normal((5, 128)).astype(np.float32))
    ws = [f32_to_bf16((rng.standard_normal((o.N, o.K)) / 8).astype(np.float32)) for o in ops]
    outs = gc.reference_chain(x, ws, ops)
    f = lambda a: bf16_to_f32(a).astype(np.float64)                       # noqa: E731
    want0 = f32_to_bf16((f(x) @ f(ws[0]).T).astype(np.float32))
    want1 = f32_to_bf16((f(want0)[:, :64] @ f(ws[1]).T).astype(np.float32))
    want2 = f32_to_bf16((f(x) @ f(ws[2]).T).astype(np.float32))
    for got, want in zip(outs, (want0, want1, want2)):
        np.testing.assert_array_equal(got, want)
