"""CPU tests of the two launches' plan knobs (issue 22): the occupancy variants (moe.cu DD_MOE_*_OCC, plugins/moe.py
OCC_KERNELS) are compiled for both archs under the names the plan launches and fit an SM the number of times they
are bounded for, or the plan says why; the measured knobs (plugins/moe_measured.py) give plans that fit, cover every
n-tile and k chunk, and stay off under the batch-invariant split; `bench moe --routing tree` ids are bench step's
tree routing (fewer distinct experts than uniform, each row top-k distinct)."""
import numpy as np
import pytest

from ddtree.plugins.moe_measured import TWO_MEASURED, two_launch_knobs
from ddtree.plugins.moe_plan import DEFAULT_RING, OCC_KERNELS, RINGS, MoEShape, plan_moe

ARCHS = {"sm_90": dict(sm_count=132, smem_limit=232448), "sm_120": dict(sm_count=188, smem_limit=101376)}
TP8 = MoEShape(7168, 256, 384, 8)
TP1 = MoEShape(7168, 2048, 384, 8)


def occ_knobs(part, ring, warps, occ, gu_splits):
    if part == "gate_up":
        return dict(gu_ring=ring, gu_warps=warps, gu_occ=occ, gu_splits=gu_splits)
    return dict(dn_ring=ring, dn_warps=warps, dn_occ=occ)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_occupancy_variants_compile_under_their_plan_names(arch):
    from ddtree.plugins.compile import compile_cubin
    cubin = compile_cubin("moe.cu", arch).read_bytes()
    for part, ring, warps, occ in OCC_KERNELS:
        assert ring in RINGS
        name = "moe_%s_r%dc%d_w%do%d" % (part, *ring, warps, occ)
        assert name.encode() + b"\0" in cubin, name
        assert 65536 // (32 * warps * occ) >= 80          # the bound leaves ptxas 80 registers (spill-free, sm_90)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_occupancy_plans_fit_or_say_why(arch):
    a = ARCHS[arch]
    made = 0
    for part, ring, warps, occ in sorted(OCC_KERNELS):
        for shape in (TP8, TP1):
            for M in (1, 9, 17, 33, 65, 256):
                try:
                    p = plan_moe(shape, M, a["sm_count"], a["smem_limit"], DEFAULT_RING.get(arch, (3, 2)),
                                 **occ_knobs(part, ring, warps, occ, 14 if warps == 4 else 7))
                except ValueError as exc:
                    assert "shared memory" in str(exc) or "no kernel" in str(exc) or "fits" in str(exc), exc
                    continue
                made += 1
                smem, name = (p.gu_smem, p.gate_up_kernel) if part == "gate_up" else (p.dn_smem, p.down_kernel)
                assert name == "moe_%s_r%dc%d_w%do%d" % (part, *ring, warps, occ)
                assert occ * (smem + 1024) <= a["smem_limit"] + 1024
    assert made > 0 or arch == "sm_120"           # sm_120's ~100 KB an SM holds none of them: they say so


def test_occupancy_knob_names_what_is_compiled():
    with pytest.raises(ValueError, match=r"no kernel for ring \(4, 2\), 8 warps, 3 blocks"):
        plan_moe(TP8, 17, 132, 232448, (4, 2), gu_warps=8, gu_splits=8, gu_occ=3)
    with pytest.raises(ValueError, match="3 blocks an SM of .* exceed"):
        plan_moe(TP8, 17, 132, 232448, (4, 2), gu_warps=8, gu_splits=4, gu_ring=(3, 2), gu_occ=3)
    p = plan_moe(TP8, 17, 132, 232448, (4, 2))
    assert (p.gu_occ, p.dn_occ, p.gate_up_kernel, p.down_kernel) == (1, 1, "moe_gate_up_r4c2", "moe_down_r6c1")


def test_measured_knobs_fit_and_cover_every_tile():
    for (arch, hidden, inter), ranges in TWO_MEASURED.items():
        a, shape = ARCHS[arch], MoEShape(hidden, inter, 384, 8)
        for first, last, knobs in ranges:
            for M in range(first, last + 1):
                assert two_launch_knobs(arch, shape, M) == knobs and two_launch_knobs(arch + "a", shape, M) == knobs
                p = plan_moe(shape, M, a["sm_count"], a["smem_limit"], DEFAULT_RING[arch], **knobs)
                assert max(p.gu_smem, p.dn_smem) <= a["smem_limit"]
                assert p.gu_nb * p.gu_warps * 2 * p.gu_tpw >= inter // 8       # gate_up: every fused n-tile
                assert p.dn_nb * p.dn_warps * 2 * p.dn_tpw >= hidden // 16     # down: every 16-row n-tile
                assert (hidden // 64) % p.gu_splits == 0 and (hidden // 64 // p.gu_splits) % p.gu_ring[1] == 0
                # 8-warp gate_up blocks two an SM (128 registers a thread) or three (an OCC variant, 80)
                if p.gu_warps == 8:
                    blocks, regs = (3, 80) if p.gu_occ == 3 else (2, 128)
                    assert p.gu_occ == 1 or ("gate_up", p.gu_ring, 8, p.gu_occ) in OCC_KERNELS
                    assert blocks * (p.gu_smem + 1024) <= a["smem_limit"] + 1024 and blocks * 256 * regs <= 65536
    assert two_launch_knobs("sm_90", TP8, 8) == {} and two_launch_knobs("sm_90", TP8, 34) == {}
    assert two_launch_knobs("sm_120", TP8, 17) == {} and two_launch_knobs("sm_90", TP1, 17) == {}


def test_bench_tree_routing_ids():
    from ddtree.bench.kernels import EXPERTS, TOPK, moe_routing_ids
    from ddtree.bench.project import DraftProfile
    from ddtree.bench.routing import reuse_rate
    rng = np.random.default_rng(3)
    for M in (1, 9, 17, 33):
        tree = np.stack([moe_routing_ids(rng, M, "tree", 0.5) for _ in range(40)])       # [40, M, k]
        uniform = np.stack([moe_routing_ids(rng, M, "uniform", 0.5) for _ in range(40)])
        for ids in (tree, uniform):
            assert ids.shape == (40, M, TOPK) and ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < EXPERTS
            assert all(len(np.unique(row)) == TOPK for launch in ids for row in launch)
        if M > 1:
            parents = DraftProfile().tree(M - 1, 7).parents
            assert abs(reuse_rate(tree, parents) - 0.5) < 4 * np.sqrt(0.25 / (40 * (M - 1) * TOPK))
            d_tree = np.mean([len(np.unique(t)) for t in tree])
            d_uni = np.mean([len(np.unique(u)) for u in uniform])
            assert d_tree < d_uni


class StubGpu:
    """What FusedMoE's constructor and plan() read of a device, with host arrays for its workspaces."""

    def __init__(self, arch: str, sm_count: int, smem_optin: int):
        self.arch, self.sm_count, self.smem_optin, self.l2_bytes = arch, sm_count, smem_optin, 50 << 20

    def alloc(self, shape, dtype):
        return np.empty(shape, dtype)

    zeros = alloc


def stub_weights(shape: MoEShape) -> dict:
    E, H, I = shape.experts, shape.hidden, shape.inter
    return {"gate_up": np.empty((E, I // 16, H // 64, 2, 32, 4), np.int32),
            "gate_up_scale": np.empty((E, I // 16, H // 64, 2, 8, 4), np.uint16),
            "down": np.empty((E, H // 32, I // 64, 2, 32, 4), np.int32),
            "down_scale": np.empty((E, H // 32, I // 64, 2, 8, 4), np.uint16)}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_fused_moe_plan_takes_the_measured_knobs(arch):
    """FusedMoE.plan(M) is plan_moe with two_launch_knobs at M (where measured: sm_90 only), its heuristic elsewhere;
    the batch-invariant plan keeps max_tokens' split at every M and takes no knobs; an override wins."""
    from ddtree.plugins.moe import FusedMoE
    a = ARCHS[arch]
    gpu = StubGpu(arch, a["sm_count"], a["smem_limit"])
    shape = MoEShape(7168, 256, 384, 8, max_tokens=65)
    moe = FusedMoE(gpu, shape, stub_weights(shape))
    ring = DEFAULT_RING.get(arch, DEFAULT_RING["default"])
    for M in range(1, 66):
        knobs = two_launch_knobs(arch, shape, M)
        assert moe.plan(M) == plan_moe(shape, M, a["sm_count"], a["smem_limit"], ring, **knobs)
        assert bool(knobs) == (arch == "sm_90" and (M == 1 or 9 <= M <= 33))
    assert moe.gu_partial.size >= max(p.tiles * p.gu_nb * p.gu_splits * p.gu_warps * 2 * p.gu_tpw * 32 * 4
                                      for p in map(moe.plan, range(1, 66)))
    invariant = FusedMoE(gpu, shape, stub_weights(shape), invariant=True)
    fixed = plan_moe(shape, 65, a["sm_count"], a["smem_limit"], ring).gu_splits
    assert {invariant.plan(M).gu_splits for M in range(1, 66)} == {fixed}
    assert invariant.plan(9) == plan_moe(shape, 9, a["sm_count"], a["smem_limit"], ring, gu_splits=fixed)
    forced = moe.override(9, dn_tpw=1)
    assert moe.plan(9) == forced and forced.dn_tpw == 1 and forced.gu_warps == plan_moe(
        shape, 9, a["sm_count"], a["smem_limit"], ring).gu_warps      # an override is plan_moe's, no measured knobs
