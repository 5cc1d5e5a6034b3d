"""GPU tests of the fused router (kernels/router.cu through plugins/router.py and FusedMoE.route).

References: the fp32 logits against reference.gemm in float64; the routing against the rule
(routing.route_logits, float64) over the kernel's own logits, identical ids (selection order) wherever the
margin is not a rounding-level near-tie, weights to fp32 tolerance; on exact logits (one nonzero per token
row) every row, ties included; against moe_route on the same logits bit for bit; tile lists checked
against the ids. Outputs are poisoned before each run, so an unwritten element fails.
"""
import numpy as np
import pytest
from moe_cases import route_only_weights

from ddtree.model.bf16 import bf16_to_f32
from ddtree.model.routing import route_logits
from ddtree.plugins import layout, randfill, reference
from ddtree.plugins.router import lanes_allowed

pytestmark = pytest.mark.gpu

SHAPES = {"kimi": dict(experts=384, hidden=7168, topk=8, n_group=1, topk_group=1, scaling=2.827),
          "grouped": dict(experts=64, hidden=512, topk=6, n_group=8, topk_group=3, scaling=1.5),
          "ragged": dict(experts=200, hidden=1024, topk=32, n_group=1, topk_group=1, scaling=1.0)}


def make_router(gpu, name, invariant=False, max_tokens=256):
    from ddtree.plugins.router import FusedRouter, RouterShape
    shape = RouterShape(**SHAPES[name], max_tokens=max_tokens)
    E, H = shape.experts, shape.hidden
    w = randfill.hash_array((E, H), np.uint16, 501, randfill.WEIGHT_BF16)
    bias = (np.random.default_rng(E).standard_normal(E) * 0.05).astype(np.float32)
    router = FusedRouter(gpu, shape, gpu.upload(layout.tile_bf16(w)), gpu.upload(bias), invariant=invariant)
    mx = shape.max_tokens
    out = dict(logits=gpu.alloc((mx, E), np.float32), ids=gpu.alloc((mx, shape.topk), np.int32),
               w=gpu.alloc((mx, shape.topk), np.float32), tile_expert=gpu.alloc(mx * shape.topk + 7 * E, np.int32),
               tile_pairs=gpu.alloc((mx * shape.topk + 7 * E, 8), np.int32), num_tiles=gpu.zeros(1, np.int32))
    return router, w, bias, out


def run(gpu, router, x, M, out, given=False):
    for key in ("logits", "w", "tile_expert", "tile_pairs"):
        gpu.memset(out[key], 0xFF)                                   # NaN / -1
    if not given:
        gpu.memset(out["ids"], 0xFF)
    router.run(gpu.upload(x) if isinstance(x, np.ndarray) else x, M, out["logits"], out["ids"], out["w"],
               (out["tile_expert"], out["tile_pairs"], out["num_tiles"]), given=given)
    gpu.sync()
    k = router.shape.topk
    return out["logits"].numpy()[:M], out["ids"].numpy()[:M].reshape(M, k), out["w"].numpy()[:M].reshape(M, k)


def check_tiles(out, ids, E):
    """Each pair once, in a tile of its expert; the fewest tiles (ceil(count / 8) per expert)."""
    n = int(out["num_tiles"].numpy()[0])
    counts = np.bincount(ids.reshape(-1), minlength=E)
    assert n == int(np.sum((counts + 7) // 8))
    experts, pairs = out["tile_expert"].numpy()[:n], out["tile_pairs"].numpy()[:n]
    flat = pairs.reshape(-1)
    assert sorted(flat[flat >= 0].tolist()) == list(range(ids.size))
    for z in range(n):
        assert all(ids.reshape(-1)[p] == experts[z] for p in pairs[z][pairs[z] >= 0])


@pytest.mark.parametrize("M", [1, 3, 17, 64, 65, 130, 256])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_fused_router_against_the_rule(gpu, name, M):
    router, w, bias, out = make_router(gpu, name)
    s = router.shape
    x = randfill.hash_array((M, s.hidden), np.uint16, 502 + M, randfill.ACT_BF16)
    logits, ids, wts = run(gpu, router, x, M, out)
    ref = reference.gemm(x, w)                                       # [M, E] float64
    assert np.abs(logits - ref).max() <= 1e-5 * np.abs(ref).max() + 1e-6
    # the rule over the kernel's own fp32 logits: equal where the margin is above fp32 sigmoid rounding
    ids_ref, w_ref, margin = route_logits(logits.astype(np.float64), bias, s.topk, s.n_group, s.topk_group, s.scaling)
    decided = margin > 1e-5
    assert decided.mean() > 0.9
    np.testing.assert_array_equal(ids[decided], ids_ref[decided])
    np.testing.assert_allclose(wts[decided], w_ref[decided], rtol=1e-5)
    check_tiles(out, ids, s.experts)
    again = run(gpu, router, x, M, out)                              # the hand-off counters were reset
    for a, b in zip(again, (logits, ids, wts)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("M", [1, 17, 64])
def test_exact_logits_route_every_row_as_the_rule(gpu, M):
    """Token m's row is 512 at one column: its logits are 512 w[:, col] exactly (one product), so the kernel
    and the rule see the same numbers; the bias (multiples of 1/8) leaves no near-tie (checked first: every
    margin is 0, an exact tie of equal logits and biases, or > 1e-4), and every row's ids and weights agree."""
    router, w, _, out = make_router(gpu, "kimi")
    s = router.shape
    bias = (np.random.default_rng(0).integers(-2, 3, s.experts) * 0.125).astype(np.float32)
    router.bias = gpu.upload(bias)
    cols = (np.arange(M) * 37 + 5) % s.hidden
    x = np.zeros((M, s.hidden), np.float32)
    x[np.arange(M), cols] = 512.0
    x_bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    exact = 512.0 * bf16_to_f32(w).astype(np.float64)[:, cols].T  # [M, E]
    ids_ref, w_ref, margin = route_logits(exact, bias, s.topk, s.n_group, s.topk_group, s.scaling)
    assert np.all((margin == 0) | (margin > 1e-4)), "test data: a near-tie"
    logits, ids, wts = run(gpu, router, x_bits, M, out)
    np.testing.assert_array_equal(logits, exact.astype(np.float32))
    np.testing.assert_array_equal(ids, ids_ref)
    np.testing.assert_allclose(wts, w_ref, rtol=1e-5)


# route_rows' shapes (FusedMoE with route-only expert buffers): kimi (16 lanes planned past 16 rows), small
# (E 64, H 512: k-split 1 possible, so the GEMM's epilogue stores the scores), ragged (topk 32: 32 lanes only,
# route_rows<32, 12> at E 200), tiny (the embedded tiny model's router: E 8, 16 lanes planned past 16 rows)
MOE_SHAPES = {**SHAPES, "small": dict(experts=64, hidden=512, topk=6, n_group=1, topk_group=1, scaling=1.5),
              "tiny": dict(experts=8, hidden=128, topk=2, n_group=1, topk_group=1, scaling=2.5)}


def moe_for(gpu, name="kimi", max_tokens=128):
    from ddtree.plugins.moe import FusedMoE, MoEShape
    r = MOE_SHAPES[name]
    E, H = r["experts"], r["hidden"]
    shape = MoEShape(H, 64, E, r["topk"], r["n_group"], r["topk_group"], r["scaling"], max_tokens=max_tokens)
    weights = route_only_weights(gpu, E, H)
    w_router = randfill.hash_array((E, H), np.uint16, 601, randfill.WEIGHT_BF16)
    bias = (np.random.default_rng(7).standard_normal(E) * 0.05).astype(np.float32)
    return FusedMoE(gpu, shape, weights, router=gpu.upload(layout.tile_bf16(w_router)), bias=gpu.upload(bias))


def kimi_moe(gpu):
    return moe_for(gpu, "kimi")


@pytest.mark.parametrize("M", [1, 17, 65])
def test_fused_equals_moe_route_bitwise(gpu, M):
    """FusedMoE.route (fused) and the route kernel it replaced, on the fused logits: the same ids and weights
    bit for bit (same fp32 sigmoid, the same order of the weights' sum); the unfused GEMM's logits agree to
    fp32 accumulation."""
    H = SHAPES["kimi"]["hidden"]
    moe = kimi_moe(gpu)
    x = gpu.upload(randfill.hash_array((M, H), np.uint16, 602 + M, randfill.ACT_BF16))
    logits, _, _ = route_checked(gpu, moe, x, M)
    moe.fused_router = False
    moe.route(x, M)
    unfused = moe.logits.numpy()[:M]
    assert np.abs(unfused - logits).max() <= 1e-5 * np.abs(logits).max()


def test_given_ids_are_aligned_and_left_alone(gpu):
    router, _, _, out = make_router(gpu, "kimi")
    s, M = router.shape, 33
    ids = np.stack([np.random.default_rng(m).permutation(s.experts)[:s.topk] for m in range(M)]).astype(np.int32)
    gpu.copy_in(out["ids"], np.concatenate([ids.reshape(-1), np.full(out["ids"].shape[0] * s.topk - ids.size, -1)]))
    x = randfill.hash_array((M, s.hidden), np.uint16, 77, randfill.ACT_BF16)
    logits, got, _ = run(gpu, router, x, M, out, given=True)
    np.testing.assert_array_equal(got, ids)
    assert np.isfinite(logits).all()                                  # the logits are still computed
    check_tiles(out, ids, s.experts)


def test_invariant_logits_do_not_depend_on_the_batch(gpu):
    router, _, _, out = make_router(gpu, "kimi", invariant=True, max_tokens=65)
    s, M = router.shape, 65
    assert len({(router.plan(m).splits, router.plan(m).kw) for m in (1, 8, 17, 33, 65)}) == 1
    x = randfill.hash_array((M, s.hidden), np.uint16, 91, randfill.ACT_BF16)
    xd = gpu.upload(x)
    batch = [a.copy() for a in run(gpu, router, xd, M, out)]
    for m in (0, 16, 64):
        one = run(gpu, router, xd.ptr + m * s.hidden * 2, 1, out)
        for a, b in zip(one, batch):
            np.testing.assert_array_equal(a[0], b[m], err_msg=f"row {m}: M = 1 != M = {M}")


@pytest.mark.parametrize("M, fold, G", [(1, False, None), (1, True, 1), (1, True, 12), (2, True, None),
                                        (3, True, 1), (8, True, 1), (17, True, None)])
def test_fold_and_spread_equal_the_two_hand_offs_and_moe_route(gpu, M, fold, G):
    """Forced plans (the planned knobs, folded or not, a warp a token or route_block's 12 warps): the logits bit
    for bit those of the unfolded plan (one summation order), the ids and weights moe_route's on them bit for
    bit, the tile lists right; and with the ids given, the same tile lists from the shared copy of the ids."""
    H = SHAPES["kimi"]["hidden"]
    moe = kimi_moe(gpu)
    x = gpu.upload(randfill.hash_array((M, H), np.uint16, 702 + M, randfill.ACT_BF16))
    planned = moe.router_fused.plan(M)
    knobs = dict(warps=planned.warps, tiles=planned.tiles, splits=planned.splits)
    moe.router_fused.override(M, fold=False, **knobs)
    moe.route(x, M)
    base = moe.logits.numpy()[:M].copy()
    plan = moe.router_fused.override(M, fold=fold, route_warps=G, **knobs)
    assert plan.fold == fold and (G is None or plan.route_warps == G)
    logits, _, _ = route_checked(gpu, moe, x, M)
    np.testing.assert_array_equal(logits, base)
    given_ids_aligned(gpu, moe, x, M)


def given_ids_aligned(gpu, moe, x, M):
    """route_given with M rows of distinct random ids: the ids left alone and aligned into the tile lists."""
    E, k = moe.shape.experts, moe.shape.topk
    given = np.stack([np.random.default_rng(m).permutation(E)[:k] for m in range(M)]).astype(np.int32)
    ids_in, w_in = gpu.upload(given), gpu.upload(np.full((M, k), 0.5, np.float32))
    gpu.memset(moe.tile_pairs, 0xFF)
    moe.route_given(x, M, ids_in, w_in)
    gpu.sync()
    np.testing.assert_array_equal(ids_in.numpy(), given)
    check_tiles({"num_tiles": moe.num_tiles, "tile_expert": moe.tile_expert, "tile_pairs": moe.tile_pairs}, given, E)


def route_checked(gpu, moe, x, M):
    """moe.route at M with every output poisoned first -> (logits, ids, weights) copies; the tile lists right
    and the ids and weights bit for bit those of moe_route (the route kernel the fused one replaced) on the
    same logits."""
    k, E = moe.shape.topk, moe.shape.experts
    fused = moe.router_fused
    for a in (moe.logits, moe.topk_w, moe.tile_expert, moe.tile_pairs, moe.topk_ids, fused.score):
        if a is not None:                               # score: only where lanes_allowed has lanes > 0
            gpu.memset(a, 0xFF)
    moe.route(x, M)
    gpu.sync()
    logits, ids, wts = (a.numpy()[:M].copy() for a in (moe.logits, moe.topk_ids, moe.topk_w))
    assert np.isfinite(logits).all() and ids.min() >= 0 and ids.max() < E
    # route_rows alone stores the scores: the plan's lanes ran (a warp a token leaves the poison)
    if fused.score is None:
        assert lanes_allowed(fused.shape, False) == (0,)
    elif moe.fused_router and fused.plan(M).lanes:
        score = fused.score.numpy()[: M * E].reshape(M, E)
        np.testing.assert_allclose(score, 1 / (1 + np.exp(-logits.astype(np.float64))), rtol=1e-6, atol=0)
    else:
        assert np.isnan(fused.score.numpy()[: M * E]).all()
    check_tiles({"num_tiles": moe.num_tiles, "tile_expert": moe.tile_expert, "tile_pairs": moe.tile_pairs}, ids, E)
    ids_old, w_old = gpu.alloc((M, k), np.int32), gpu.alloc((M, k), np.float32)
    moe.launch_route(moe.logits, M, ids_old, w_old, None)
    gpu.sync()
    np.testing.assert_array_equal(ids_old.numpy(), ids)
    np.testing.assert_array_equal(w_old.numpy().view(np.uint32), wts.view(np.uint32))   # bit for bit
    return logits, ids, wts


@pytest.mark.parametrize("M", [16, 17, 24, 32, 33, 48, 64, 65, 100, 128])
def test_route_rows_planned_equal_moe_route(gpu, M):
    """The planned route phase (on the H200: 16 lanes a row past 16 rows, a warp a token up to 16): ids and
    weights bit for bit moe_route's on the same logits; the logits, ids and weights bit for bit those of the
    same knobs routed a warp a token (lanes 0, the committed route phase); a second run (counters reset, the
    scores rewritten) gives the same bits."""
    H = MOE_SHAPES["kimi"]["hidden"]
    moe = kimi_moe(gpu)
    x = gpu.upload(randfill.hash_array((M, H), np.uint16, 802 + M, randfill.ACT_BF16))
    plan = moe.router_fused.plan(M)
    if gpu.arch.rstrip("a") == "sm_90":
        assert plan.lanes == (16 if M > 16 else 0) and not plan.fold
    got = route_checked(gpu, moe, x, M)
    again = route_checked(gpu, moe, x, M)
    moe.router_fused.override(M, warps=plan.warps, tiles=plan.tiles, splits=plan.splits, fold=plan.fold, lanes=0)
    warp_a_token = route_checked(gpu, moe, x, M)
    for a, b, c in zip(got, again, warp_a_token):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
        np.testing.assert_array_equal(a.view(np.uint32), c.view(np.uint32))


@pytest.mark.parametrize("name, M, knobs", [
    ("kimi", 3, dict(lanes=16)),                       # fewer rows than segments (idle segments write nothing)
    ("kimi", 9, dict(lanes=16)),
    ("kimi", 17, dict(lanes=32)),                      # a warp a row from the scores: two rounds of 16
    ("kimi", 33, dict(lanes=32)),
    ("kimi", 64, dict(lanes=32)),                      # four rounds
    ("kimi", 17, dict(warps=8, lanes=16)),             # 16 segments: two rounds
    ("kimi", 64, dict(warps=4, lanes=16)),             # 8 segments: eight rounds
    ("kimi", 65, dict(warps=8, lanes=16)),             # two token blocks of 40 and 25 rows, 16 segments each
    ("kimi", 128, dict(lanes=32)),
    ("small", 40, dict(warps=8, tiles=2, splits=2, lanes=16)),   # the k-split hand-off stores the scores
    ("small", 40, dict(splits=1, lanes=16)),           # S = 1: the GEMM epilogue stores the scores
    ("small", 40, dict(splits=1, tiles=4, lanes=16)),  # S = 1 and one n-block: no hand-off before the routing
    ("small", 100, dict(splits=1, lanes=16)),          # two token blocks
    ("ragged", 40, dict(tiles=2, splits=2, lanes=32)),  # topk 32, E 200: route_rows<32, 12>
    ("ragged", 40, dict(splits=1, lanes=32)),
    ("tiny", 17, dict()),                              # planned (16 lanes past 16 rows), E 8: lanes past E idle
    ("tiny", 100, dict()),
])
def test_route_rows_forced_equal_moe_route(gpu, name, M, knobs):
    """Forced plans: the knobs routed a warp a token (lanes 0) first, then with the forced lanes: the logits bit
    for bit the same (the same sums), the ids and weights bit for bit moe_route's on them, the tile lists
    right; then the ids given (route_given): left alone and aligned."""
    H = MOE_SHAPES[name]["hidden"]
    moe = moe_for(gpu, name)
    x = gpu.upload(randfill.hash_array((M, H), np.uint16, 902 + M, randfill.ACT_BF16))
    planned, forced = moe.router_fused.plan(M), dict(knobs)
    lanes = forced.pop("lanes", planned.lanes)
    if not knobs and gpu.arch.rstrip("a") == "sm_90":    # the planned plan (nothing forced)
        assert lanes == 16, f"{name} at {M} rows: planned lanes {lanes}"
    knobs = dict(dict(warps=planned.warps, tiles=planned.tiles, splits=planned.splits), **forced)
    try:
        moe.router_fused.override(M, fold=False, lanes=0, **knobs)
    except ValueError as exc:                          # (the H200 has them all; a 99 KB device not)
        pytest.skip(f"no such plan on {gpu.arch}: {exc}")
    base = route_checked(gpu, moe, x, M)
    plan = moe.router_fused.override(M, fold=False, lanes=lanes, **knobs)
    assert plan.lanes == lanes and all(getattr(plan, key) == v for key, v in knobs.items())
    got = route_checked(gpu, moe, x, M)
    for a, b in zip(got, base):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    given_ids_aligned(gpu, moe, x, M)
