"""CPU tests of moe_down_cols (kernels/moe_down_cols.cuh, plugins/moe_down_cols.py): its schedule gives every
(tile, tile pair) to exactly one warp, the numpy twin of the schedule and the combine equals the float64 reference
moe_given_routing, its plans fit sm_90's and sm_120's shared memory where they say so and name what does not fit,
and FusedMoE takes it only where asked or measured, never beside a down k-split."""
import numpy as np
import pytest
from moe_cases import random_experts

from ddtree.plugins import layout, reference
from ddtree.plugins.moe_down_cols import (
    COLS_MEASURED,
    ColsPlan,
    cols_default,
    cols_items,
    cols_smem,
    plan_down_cols,
    simulate_down_cols,
)
from ddtree.plugins.moe_plan import MoEShape, plan_moe

ARCHS = {"sm_90": dict(sm_count=132, smem_limit=232448), "sm_120": dict(sm_count=188, smem_limit=101376)}
TP8 = MoEShape(7168, 256, 384, 8, 1, 1, 2.827, 256)


@pytest.mark.parametrize("tiles,NP,upb,warps", [(8, 224, 2, 16), (40, 224, 2, 8), (3, 224, 1, 16), (13, 8, 3, 4),
                                                 (1, 5, 2, 8), (70, 224, 4, 16)])
def test_schedule_gives_every_item_to_one_warp(tiles, NP, upb, warps):
    p = ColsPlan(warps, upb, (3, 2), -(-NP // upb), tiles, 0)
    seen = [item for block in cols_items(tiles, NP, p) for items in block for item in items]
    assert sorted(seen) == [(z, u) for z in range(tiles) for u in range(NP)]
    for b, block in enumerate(cols_items(tiles, NP, p)):       # a block's items are its own tile pairs
        assert {u for items in block for _, u in items} <= set(range(b * upb, min(NP, (b + 1) * upb)))
        counts = [len(items) for items in block]
        assert max(counts) - min(counts) <= 1                   # warps take items in turn


@pytest.mark.parametrize("M,upb,warps", [(1, 1, 4), (3, 2, 8), (5, 3, 2), (9, 8, 16)])
def test_simulated_schedule_equals_the_reference(M, upb, warps):
    """The twin runs each warp's items on exactly its 32 columns of the tile's pairs into the block's y, then the
    block's combine over its columns, and asserts nothing is read unwritten or written twice."""
    rng = np.random.default_rng(M)
    E, H, I, topk = 6, 256, 128, 4
    packed = layout.repack_experts(random_experts(rng, E, H, I, 0.05))
    shape = MoEShape(H, I, E, topk, max_tokens=32)
    p = plan_down_cols(shape, M, 132, 232448, warps=warps, upb=upb)
    x = rng.standard_normal((M, H))
    ids = np.stack([rng.permutation(E)[:topk] for _ in range(M)]).astype(np.int32)
    if M == 9:                                                  # 9 pairs of expert 2: two tiles of it
        ids = np.stack([[2, *rng.permutation([0, 1, 3, 4, 5])[:topk - 1]] for _ in range(M)]).astype(np.int32)
    w = rng.uniform(0.2, 1.0, (M, topk))
    shared = rng.standard_normal((M, H))
    act = np.zeros((M * topk, I))
    for e in range(E):                                          # moe_gate_up's rows: act[pair]
        gate, up, _ = reference.expert_matrices(packed, e)
        pairs = np.nonzero(ids.reshape(-1) == e)[0]
        xe = x[pairs // topk]
        act[pairs] = reference.silu(xe @ gate.T) * (xe @ up.T)
    got = simulate_down_cols(act, ids, w, packed, p, shared=shared)
    want = reference.moe_given_routing(x, ids, w, packed, shared=shared)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


@pytest.mark.parametrize("arch,last_m", [("sm_90", 17), ("sm_120", 9)])
def test_plans_fit_each_arch_where_they_say(arch, last_m):
    """tp 8 (hidden 7168, inter 256): every M up to 17 rows fits sm_90's 227 KB, up to 9 sm_120's 99 KB; each plan's
    bytes are its parts' sum and within the limit; one grid of at most one block an SM."""
    a = ARCHS[arch]
    for M in range(1, last_m + 1):
        p = plan_down_cols(TP8, M, a["sm_count"], a["smem_limit"])
        assert p.smem == cols_smem(TP8, M, p.warps, p.upb, p.ring) <= a["smem_limit"]
        assert p.blocks == -(-224 // p.upb) <= a["sm_count"]
        assert p.max_tiles == TP8.max_tiles(M) and p.kernel == "moe_down_cols_r3c2"
        P = M * 8                                               # rings + act + corrections + y + tile lists
        assert p.smem == p.warps * 3 * 2 * 2304 // 2 + (P + 1) * 288 * 2 + P * 8 * 4 + P * 128 * p.upb + p.max_tiles * 36


def test_a_plan_that_does_not_fit_names_its_bytes():
    with pytest.raises(ValueError, match=r"M = 33 \(264 act rows of 256\) needs \d+ B of shared memory.*allows"):
        plan_down_cols(TP8, 33, 188, 101376)
    with pytest.raises(ValueError, match="ring"):
        plan_down_cols(TP8, 1, 132, 232448, ring=(5, 2))


def test_fused_moe_takes_it_only_where_asked_or_measured():
    """down_cols None: only where COLS_MEASURED says (and the plan fits); True wherever its plan fits; never beside
    a down k-split above 1 (its sums are moe_down's at one split)."""
    from ddtree.plugins.moe import FusedMoE

    class Stub:                                                # the plan's view of a device, no GPU
        arch, sm_count, smem_optin = "sm_90", 132, 232448

    moe = FusedMoE.__new__(FusedMoE)
    moe.gpu, moe.shape, moe.ring, moe.fixed_splits = Stub(), TP8, (4, 2), None
    moe._overrides, moe._cols_overrides = {}, {}
    moe.down_cols = None
    measured = [M for M in range(1, 65) if cols_default("sm_90", TP8, M) is not None]
    assert [M for M in range(1, 65) if moe.uses_down_cols(M)] == [M for M in measured if M <= 17]
    moe.down_cols = True
    fits = [M for M in range(1, 65) if moe.uses_down_cols(M)]         # 8 warps past 16 rows, 4 past 24
    assert fits == list(range(1, fits[-1] + 1)) and 24 < fits[-1] < 33
    moe._overrides[9] = plan_moe(TP8, 9, 132, 232448, (4, 2), dn_splits=2)
    assert not moe.uses_down_cols(9)
    moe.down_cols = None
    assert not moe.uses_down_cols(9)
    moe.down_cols = False
    assert not any(moe.uses_down_cols(M) for M in range(1, 65))
    assert all(key[0] in ("sm_90", "sm_120") for key in COLS_MEASURED)
