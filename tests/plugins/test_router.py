"""CPU tests of the fused router (plugins/router.py, kernels/router.cu): its selection's numpy twin picks
what the routing rule picks (routing.topk_lowest_id / route_logits), ties and masked experts included, with
no more candidates than the kernel's buffer; every plan fits both archs' shared memory (H200 sm_90: 227 KB,
RTX PRO 6000 sm_120: 99 KB) and covers every row, expert and k-chunk; the batch-invariant plan is one split
order for every M; bad knobs are named."""
import struct
from dataclasses import replace

import numpy as np
import pytest

from ddtree.model.routing import route_logits, topk_lowest_id
from ddtree.plugins import compile as kc
from ddtree.plugins.router import (
    MAX_WARPS,
    STATIC_SMEM,
    RouterShape,
    invariant_knobs,
    lanes_allowed,
    plan_router,
    route_ref,
    router_smem,
    row_lanes,
    select_ref,
)

ARCHS = {"sm_90": dict(sm_count=132, smem_limit=232448), "sm_120": dict(sm_count=188, smem_limit=101376)}
SHAPES = {"kimi_tp8": RouterShape(384, 7168, 8, scaling=2.827),
          "grouped": RouterShape(64, 512, 6, n_group=8, topk_group=3, scaling=1.5),
          "small": RouterShape(16, 1024, 4, scaling=2.5),
          "ragged": RouterShape(200, 2048, 32, max_tokens=64),
          "tiny": RouterShape(8, 128, 2, scaling=2.5, max_tokens=256)}     # the embedded tiny model's MoE


@pytest.mark.parametrize("block, lanes", [(False, 0), (False, 16), (True, 0)])
@pytest.mark.parametrize("E, k", [(384, 8), (512, 32), (512, 16), (200, 7), (200, 32), (33, 2), (16, 4), (8, 8),
                                  (64, 1)])
def test_selection_twin_equals_the_rule(E, k, block, lanes):
    """One warp a token (warp_topk, route_rows<32, .>), a segment of 16 lanes a token (route_rows<16, 24>), or
    (block) route_block's G = ceil(E / 32) >= k warps, one expert a thread."""
    G = -(-E // 32) if block else 1
    if block and G < k:
        pytest.skip(f"route_block needs ceil(E / 32) >= topk ({G} < {k})")
    if lanes == 16 and (k > 16 or E > 384):
        pytest.skip("16 lanes a row need topk <= 16 and E <= 16 x 24")
    rng = np.random.default_rng(E * 100 + k)
    for trial in range(40):
        kind = trial % 4
        if kind == 0:                              # continuous
            choice = rng.standard_normal(E)
        elif kind == 1:                            # many exact ties: the lower id must win
            choice = rng.integers(0, 3, E).astype(np.float64)
        elif kind == 2:                            # all equal
            choice = np.full(E, 0.25)
        else:                                      # masked experts (a dropped group) at -inf, ties among them
            choice = rng.standard_normal(E)
            choice[rng.random(E) < 0.7] = -np.inf
            if np.isfinite(choice).sum() < k:
                choice[:k] = 1.0
        got = select_ref(choice, k, G, lanes)
        want = topk_lowest_id(choice[None], k)[0]
        np.testing.assert_array_equal(got, want, err_msg=f"E {E} k {k} G {G} lanes {lanes} trial {trial}")


def test_selection_candidates_fit_the_kernel_buffer_at_worst():
    """The candidates come from k lanes: k ceil(E/L) at most, reached when each of k lanes holds its
    whole column above every other lane (select_ref raises past the bound); route_block's from k warps: 32 k
    at most, when k warps hold all their experts above every other warp."""
    E, k = 384, 8
    choice = np.zeros(E)
    for lane in range(k):
        choice[lane::32] = 10.0 + lane              # lanes 0..7 hold all 12 of their experts high
    assert list(select_ref(choice, k)) == list(topk_lowest_id(choice[None], k)[0])
    choice = np.zeros(E)
    for lane in range(k):
        choice[lane::16] = 10.0 + lane              # 16 lanes a row: lanes 0..7 hold all 24 high, 192 candidates
    assert list(select_ref(choice, k, lanes=16)) == list(topk_lowest_id(choice[None], k)[0])
    choice = np.zeros(E)
    choice[:32 * k] = 10.0                          # warps 0..7 all equal and high: 256 candidates
    assert list(select_ref(choice, k, 12)) == list(range(k))


@pytest.mark.parametrize("name, G, lanes", [("kimi_tp8", 1, 0), ("kimi_tp8", 12, 0), ("kimi_tp8", 1, 16),
                                            ("grouped", 1, 0), ("small", 1, 0), ("small", 1, 16), ("ragged", 1, 32),
                                            ("tiny", 1, 16)])
def test_route_twin_matches_route_logits(name, G, lanes):
    shape = SHAPES[name]
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((64, shape.experts)) * 2).astype(np.float32)
    bias = (rng.standard_normal(shape.experts) * 0.05).astype(np.float32)
    ids, w = route_ref(logits, bias, shape, G, lanes)
    ids_ref, w_ref, margin = route_logits(logits.astype(np.float64), bias, shape.topk, shape.n_group,
                                          shape.topk_group, shape.scaling)
    decided = margin > 1e-5                        # fp32 scores vs float64: a rounding-level margin may flip
    assert decided.mean() > 0.9
    np.testing.assert_array_equal(ids[decided], ids_ref[decided])
    np.testing.assert_allclose(w[decided], w_ref[decided], rtol=2e-6)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_plans_fit_and_cover(arch, name):
    a, shape = ARCHS[arch], SHAPES[name]
    kc, nt = shape.hidden // 64, -(-shape.experts // 16)
    for M in range(1, shape.max_tokens + 1):
        p = plan_router(M, shape, a["sm_count"], a["smem_limit"])
        assert p.smem + STATIC_SMEM <= a["smem_limit"], f"{arch} {name} M={M}: {p.smem} B"
        assert p.warps * 32 <= MAX_WARPS * 32 and p.warps % p.tiles == 0
        # every warp has a chunk, unless K has fewer chunks than a block's warps (the tiny model: 2)
        assert kc % p.splits == 0 and (kc // p.splits >= p.kw or (p.splits == 1 and kc < p.kw))
        assert p.nb * p.tiles >= nt > (p.nb - 1) * p.tiles              # every expert tile, no empty n-block
        assert p.mb * 8 * p.mt >= M and p.mb <= 65535 and p.splits * p.nb <= 65535 * 65535
        assert p.smem == router_smem(M, shape, p.mt, p.warps, p.tiles, p.splits, p.fold, p.route_warps, p.lanes)
        # route_rows: 16 lanes a row past 16 rows where allowed and its shared memory fits, else a warp a token
        want = row_lanes(min(M, 8 * p.mt), p.warps, shape, p.fold)
        assert p.lanes in lanes_allowed(shape, p.fold) and p.lanes in (want, 0) and (M > 16 or p.lanes == 0)
        if p.lanes != want:
            lanes_smem = router_smem(M, shape, p.mt, p.warps, p.tiles, p.splits, p.fold, p.route_warps, want)
            assert lanes_smem + STATIC_SMEM > a["smem_limit"], f"{arch} {name} M={M}: 16 lanes fit but not taken"
        knobs = dict(warps=p.warps, tiles=p.tiles, splits=p.splits, fold=p.fold)
        assert plan_router(M, shape, a["sm_count"], a["smem_limit"], **knobs) == p
        # route_block: folded (the logits in shared memory), ungrouped, G = ceil(E / 32) >= topk warps a row
        rows, g = min(M, 8 * p.mt), -(-shape.experts // 32)
        assert p.route_warps == 1 or (p.fold and shape.n_group == 1 and p.route_warps == g >= shape.topk
                                      and rows * g <= p.warps)


def test_few_rows_fold_and_route_block():
    """Kimi tp 8 at 1 row: one hand-off, the token over 12 of the 16 warps (one expert a thread); at 2 rows a
    warp a token (24 warps would be needed); from 3 rows on the two hand-offs (the folded block's passes over
    rows x E logits cost more than the hand-off it saves: the H200 sweep, 10.25 vs 9.73 us at 3 rows). Only
    where there are two hand-offs to fold (S > 1, NB > 1): never for the tiny model."""
    shape, a = SHAPES["kimi_tp8"], ARCHS["sm_90"]
    one = plan_router(1, shape, a["sm_count"], a["smem_limit"])
    assert (one.fold, one.route_warps) == (True, 12)
    two = plan_router(2, shape, a["sm_count"], a["smem_limit"])
    assert (two.fold, two.route_warps) == (True, 1)
    for M, lanes in ((3, 0), (8, 0), (16, 0), (17, 16), (24, 16), (32, 16), (33, 16), (48, 16), (64, 16), (65, 16),
                     (256, 16)):
        p = plan_router(M, shape, a["sm_count"], a["smem_limit"])   # route_rows: 16 lanes a row past 16 rows
        assert (p.fold, p.route_warps, p.lanes) == (False, 1, lanes)
    assert one.lanes == two.lanes == 0
    for M in (1, 2, 17, 256):
        assert not plan_router(M, SHAPES["tiny"], a["sm_count"], a["smem_limit"]).fold
    grouped = SHAPES["grouped"]
    assert plan_router(1, grouped, a["sm_count"], a["smem_limit"], fold=True).route_warps == 1
    assert plan_router(17, grouped, a["sm_count"], a["smem_limit"]).lanes == 0          # a token in one warp
    assert plan_router(17, SHAPES["ragged"], a["sm_count"], a["smem_limit"]).lanes == 0  # topk 32 > 16 lanes
    # sm_120 (99 KB): 32 rows staged and 32 segments' candidate buffers do not fit at 32..56 rows (a warp a token)
    b = ARCHS["sm_120"]
    assert [plan_router(M, shape, b["sm_count"], b["smem_limit"]).lanes for M in (16, 17, 31, 32, 56, 57, 65)] \
        == [0, 16, 16, 0, 0, 16, 16]


def test_lanes_leave_the_gemm_plan_alone(monkeypatch):
    """route_rows' lanes are chosen after the knobs: (mt, mb, warps, tiles, splits, fold, G) are those planned
    with a warp a token everywhere (row_lanes patched to 0), at every M and both archs."""
    from ddtree.plugins import router
    shape = SHAPES["kimi_tp8"]
    for arch, a in ARCHS.items():
        with_lanes = [plan_router(M, shape, a["sm_count"], a["smem_limit"]) for M in range(1, 257)]
        with monkeypatch.context() as mp:
            mp.setattr(router, "row_lanes", lambda *args: 0)
            without = [plan_router(M, shape, a["sm_count"], a["smem_limit"]) for M in range(1, 257)]
        for M, p, q in zip(range(1, 257), with_lanes, without):
            assert q.lanes == 0 and p == replace(q, lanes=p.lanes, smem=p.smem), f"{arch} M={M}"
            assert p.lanes or p.smem == q.smem


def test_smem_formula_by_hand():
    """Kimi tp 8 at M = 17, 16 warps as 2 tiles x 8, 8 splits: x rows 24 x (896 + 32) bf16 + 16 warps x 2
    chunks x 2 KB; the routing scratch 16 x (3 x 8 x 12 + 16) x 4 B and the tile lists are smaller. At one row
    (one token block: the ids' shared copy, 8 x 4 B -> 32), folded with route_block: the logits row and the
    bias 384 x 4 B each and route_block's (36 + 98 x 8) floats; folded with a warp a token: the warps' scratch."""
    shape = SHAPES["kimi_tp8"]
    assert router_smem(17, shape, 3, 16, 2, 8) == 24 * 928 * 2 + 16 * 2 * 2048
    assert router_smem(1, shape, 1, 16, 16, 112) == max(8 * 96 * 2 + 16 * 2048, 32 + 16 * (3 * 96 + 16) * 4,
                                                        32 + (2 * 384 + 1) * 4 + 8 * 2)
    # 9 rows at 16 lanes a row (route_rows): the bias, the round's 9 rows of scores and 16 warps x 2 segments x
    # (2 x 8 x 24 + 8) floats (candidates' choices and ids, the selection's ids) bind, beside the ids' copy
    # (9 x 8 x 4 B); the GEMM's 16 x 96 bf16 + 16 x 2 KB is less
    assert router_smem(9, shape, 2, 16, 16, 112, lanes=16) == 288 + (384 + 9 * 384 + 16 * 2 * (2 * 8 * 24 + 8)) * 4
    # 40 rows at 32 lanes (a warp a row): 16 rounds' rows of 16, 16 x (2 x 8 x 12 + 8) floats
    assert router_smem(40, shape, 5, 16, 16, 112, lanes=32) == max(40 * 96 * 2 + 16 * 2048, 1280 + (384 + 16 * 384
                                                                   + 16 * (2 * 8 * 12 + 8)) * 4)
    wide = RouterShape(512, 1024, 32)             # the routing phase binds: 16 x (3 x 32 x 16 + 64) floats
    assert router_smem(1, wide, 1, 16, 16, 16, True, 1) == 128 + 2 * 2048 + 16 * (3 * 512 + 64) * 4
    assert router_smem(1, wide, 1, 16, 16, 16, True, 16) == max(8 * 96 * 2 + 16 * 2048,
                                                                128 + 2 * 2048 + (36 + 98 * 32) * 4)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("max_tokens", [1, 16, 57, 65, 100, 256])
def test_invariant_plan_is_one_split_order(arch, max_tokens):
    """One (warps, tiles, splits) for every M up to max_tokens, fitting at each (65 rows: two blocks of 40
    and 25, narrower than 57..64's one block of 64: the H200 run of b851a9b's GPU test found the plan taken at
    max_tokens that did not fit at 49 rows)."""
    a = ARCHS[arch]
    shape = RouterShape(384, 7168, 8, scaling=2.827, max_tokens=max_tokens)
    fixed = invariant_knobs(shape, a["sm_count"], a["smem_limit"])
    for M in range(1, max_tokens + 1):
        p = plan_router(M, shape, a["sm_count"], a["smem_limit"], **fixed)
        assert (p.warps, p.tiles, p.splits) == (fixed["warps"], fixed["tiles"], fixed["splits"])
        assert p.smem + STATIC_SMEM <= a["smem_limit"]


def shared_section_bytes(cubin: bytes, kernel: str) -> int:
    """Size of the cubin's .nv.shared.<kernel> section (a 64-bit little-endian ELF)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names_at = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    names = headers[names_at][4]
    for name_at, _, _, _, _, size in headers:
        if cubin[names + name_at: cubin.index(b"\0", names + name_at)] == f".nv.shared.{kernel}".encode():
            return size
    raise AssertionError(f"no shared-memory section for {kernel}")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_static_shared_memory_within_the_plans_reserve(arch):
    """The plans leave STATIC_SMEM of the opt-in limit to the kernel's static shared memory. The section also
    holds the 1 KB a block's system reservation takes (the 16-byte flag of the kernel before the scan's totals
    showed as 1040 B): at most
    1024 + STATIC_SMEM, and more than 1024 (the hand-off flag and the scan's warp totals are there)."""
    cubin = kc.compile_cubin("router.cu", arch).read_bytes()
    for mt in range(1, 9):
        size = shared_section_bytes(cubin, f"router_fused_mt{mt}")
        assert 1024 + 4 + 32 * 4 <= size <= 1024 + STATIC_SMEM, f"router_fused_mt{mt} {arch}: {size} B"


def test_bad_knobs_are_named():
    shape, a = SHAPES["kimi_tp8"], ARCHS["sm_90"]
    with pytest.raises(ValueError, match="warps must be one of"):
        plan_router(1, shape, a["sm_count"], a["smem_limit"], warps=6)
    with pytest.raises(ValueError, match="splits 5 must divide hidden / 64 = 112"):
        plan_router(1, shape, a["sm_count"], a["smem_limit"], splits=5)
    with pytest.raises(ValueError, match="tiles 25 must be in"):
        plan_router(1, shape, a["sm_count"], a["smem_limit"], tiles=25)
    with pytest.raises(ValueError, match="no plan for M = 64"):
        plan_router(64, shape, a["sm_count"], 101376, warps=16, tiles=1, splits=1)
    with pytest.raises(ValueError, match="topk <= 32"):
        RouterShape(384, 7168, 33)
    with pytest.raises(ValueError, match="hidden must be a positive multiple of 64"):
        RouterShape(384, 7000, 8)
