"""CPU tests of the streaming MoE launch (kernels/moe_stream.cuh, plugins/moe_stream.py): its plans fit the shared
memory of both target archs (sm_90 227 KB, sm_120 99 KB per block) at the tp 1 / tp 8 shapes and every M, the
ticket order puts every gate_up item before any down item and covers each (tile, split, n-block) once, and the
numpy twin of the schedule (each item on exactly its slice, split partials and combine by counters) equals the
float64 reference moe_given_routing."""
import numpy as np
import pytest
from moe_cases import random_experts

from ddtree.plugins import layout, reference
from ddtree.plugins.moe_plan import (
    DEFAULT_RING,
    ONE_CHUNK_RING,
    RINGS,
    STAGE_BYTES,
    MoEShape,
    plan_moe,
    plan_moe_stream,
)
from ddtree.plugins.moe_stream import (
    BAR_BYTES,
    DOWN_WAVES,
    REGS_PER_THREAD,
    STATIC_SMEM,
    STREAM_MEASURED,
    align_tiles,
    first_round,
    looks_ahead,
    pinned_count,
    pinned_items,
    schedule,
    simulate_stream,
    stream_default,
    stream_items,
    stream_knobs,
    x_bytes,
)

ARCHS = {"sm_90": dict(sm_count=132, smem_limit=232448, l2=50 << 20),
         "sm_120": dict(sm_count=188, smem_limit=101376, l2=128 << 20)}
SHAPES = {"tp1": MoEShape(7168, 2048, 384, 8), "tp8": MoEShape(7168, 256, 384, 8)}


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_stream_plans_fit(arch, name):
    a, shape = ARCHS[arch], SHAPES[name]
    ring = DEFAULT_RING.get(arch, DEFAULT_RING["default"])
    for M in range(1, 257):
        base = plan_moe(shape, M, a["sm_count"], a["smem_limit"], ring)
        p = plan_moe_stream(shape, M, a["sm_count"], a["smem_limit"], ring, a["l2"])
        assert p.smem <= a["smem_limit"] and p.ring in RINGS and p.kernel == "moe_stream_r%dc%d" % p.ring
        # the same gate_up sums as the two launches: same k-split, tile pairs and warps
        assert (p.gu_splits, p.gu_tpw, p.gu_nb, p.warps) == (base.gu_splits, base.gu_tpw, base.gu_nb, base.gu_warps)
        # both parts' k spans are whole ring slots
        assert (shape.hidden // 64 // p.gu_splits) % p.ring[1] == 0 and (shape.inter // 64) % p.ring[1] == 0
        assert p.smem == max(x_bytes(shape.hidden // p.gu_splits), x_bytes(shape.inter)) \
            + p.warps * p.ring[0] * p.ring[1] * STAGE_BYTES
        # every n-tile of both parts has a warp; the grid fits the SMs' registers and shared memory at once
        assert p.gu_nb * p.warps * 2 * p.gu_tpw >= shape.inter // 8
        assert p.dn_nb * p.warps * 2 * p.dn_tpw >= shape.hidden // 16
        per_sm = p.blocks // a["sm_count"]
        assert p.blocks % a["sm_count"] == 0 and per_sm >= 1
        assert per_sm * p.warps * 32 * REGS_PER_THREAD <= 65536 and per_sm * (p.smem + 1024) <= a["smem_limit"] + 1024
        assert p.prefetch_tiles == 0                                     # L2 prefetch: a knob, off by default
        # down tile pairs per warp: the n-tiles split evenly, and at least DOWN_WAVES items per block of the grid
        # at the typical tile count unless one pair per warp
        n_tiles = shape.hidden // 16
        assert n_tiles % (2 * p.warps * p.dn_tpw) == 0
        typical = min(p.tiles, max(M, min(M * shape.topk, shape.experts)))
        assert p.dn_tpw == 1 or typical * p.dn_nb >= DOWN_WAVES * p.blocks


@pytest.mark.parametrize("hidden, inter", [(128, 64), (192, 64), (256, 128), (7168, 64)])
def test_stream_small_shapes_fall_back_to_one_chunk_slots(hidden, inter):
    shape = MoEShape(hidden, inter, 16, 4, max_tokens=64)
    for arch, a in ARCHS.items():
        ring = DEFAULT_RING.get(arch, DEFAULT_RING["default"])
        for M in (1, 5, 17, 64):
            p = plan_moe_stream(shape, M, a["sm_count"], a["smem_limit"], ring, a["l2"])
            assert (inter // 64) % p.ring[1] == 0 and (hidden // 64 // p.gu_splits) % p.ring[1] == 0
            if (inter // 64) % ring[1]:
                assert p.ring == ONE_CHUNK_RING


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_bulk_and_pinned_plans_fit_or_say_why(arch, name):
    """Bulk rings add a warp's slots' mbarriers; a pinned down item its slots (all of its chunks) and theirs. Every
    plan that is made fits the opt-in shared memory beside the kernel's static bytes, and its pinned slots fit the
    ring's slot walk; the others fail naming the shared memory or the slots."""
    a, shape = ARCHS[arch], SHAPES[name]
    ring = DEFAULT_RING.get(arch, DEFAULT_RING["default"])
    made = []
    for M in range(1, 257):
        plain = plan_moe_stream(shape, M, a["sm_count"], a["smem_limit"], ring, a["l2"])
        bulk = plan_moe_stream(shape, M, a["sm_count"], a["smem_limit"], ring, a["l2"], bulk=True)
        assert bulk.kernel == plain.kernel + "_bulk" and bulk.smem == plain.smem + plain.warps * plain.ring[0] * BAR_BYTES
        try:
            p = plan_moe_stream(shape, M, a["sm_count"], a["smem_limit"], ring, a["l2"], bulk=True, pin=True)
        except ValueError as exc:
            assert "shared memory" in str(exc) or "slots a warp exceed" in str(exc), exc
            continue
        made.append(M)
        slot = p.ring[1] * STAGE_BYTES
        assert p.pin and p.pin_slots == p.dn_tpw * (shape.inter // 64) // p.ring[1] <= p.ring[0]
        assert p.smem == bulk.smem + p.warps * p.pin_slots * (slot + BAR_BYTES) and p.dn_tpw == bulk.dn_tpw
        assert p.smem + STATIC_SMEM <= a["smem_limit"]
    if arch == "sm_90" and name == "tp8":
        assert made == [1]                  # M = 1: S 14, 16 warps, 4 x 2 ring, one tile pair a warp (231680 B)
    with pytest.raises(ValueError, match="pin needs bulk"):
        plan_moe_stream(shape, 1, a["sm_count"], a["smem_limit"], ring, a["l2"], pin=True)


def test_stream_plan_knobs_are_checked():
    shape = SHAPES["tp8"]
    with pytest.raises(ValueError, match="blocks_per_sm 2 outside"):
        plan_moe_stream(shape, 1, 132, 232448, (4, 2), blocks_per_sm=2)          # 16 warps x 128 registers
    p = plan_moe_stream(shape, 1, 132, 232448, (4, 2), gu_warps=8, gu_splits=16, blocks_per_sm=2, dn_tpw=2,
                        prefetch=0)
    assert (p.warps, p.gu_splits, p.blocks, p.dn_tpw, p.dn_nb, p.prefetch_tiles) == (8, 16, 264, 2, 14, 0)


@pytest.mark.parametrize("tiles, S, gu_nb, dn_nb", [(1, 1, 1, 1), (8, 14, 1, 14), (5, 2, 8, 28), (137, 4, 2, 7)])
def test_ticket_order_covers_every_item_once_gate_up_first(tiles, S, gu_nb, dn_nb):
    p = plan_moe_stream(SHAPES["tp8"], 1, 132, 232448, (4, 2))
    p = type(p)(**{**p.__dict__, "gu_splits": S, "gu_nb": gu_nb, "dn_nb": dn_nb})
    items = stream_items(tiles, p)
    gate_up = [i for i in items if i[0] == "gate_up"]
    down = [i for i in items if i[0] == "down"]
    assert items == gate_up + down
    assert sorted(gate_up) == sorted(("gate_up", z, s, b) for z in range(tiles) for s in range(S) for b in range(gu_nb))
    assert sorted(down) == sorted(("down", z, b) for z in range(tiles) for b in range(dn_nb))
    assert [i[1] for i in gate_up] == sorted(i[1] for i in gate_up)     # z-major: early tiles' act completes first
    assert [i[1] for i in down] == sorted(i[1] for i in down)


@pytest.mark.parametrize("tiles, dn_tpw, blocks", [(8, 1, 132), (8, 2, 132), (1, 1, 132), (40, 1, 132), (8, 1, 5)])
def test_pinned_items_and_queue_cover_every_item_once(tiles, dn_tpw, blocks):
    """With pin, block b < min(grid, down items) owns down item b; the queue hands out every gate_up item, then the
    down items from the pinned count on: together every item once, gate_up first in the queue."""
    p = plan_moe_stream(SHAPES["tp8"], 1, 132, 232448, (4, 2), bulk=True, pin=True, dn_tpw=dn_tpw, gu_warps=8)
    p = type(p)(**{**p.__dict__, "blocks": blocks})
    queue, pinned = stream_items(tiles, p), pinned_items(tiles, p)
    n_gu = tiles * p.gu_nb * p.gu_splits
    assert len(pinned) == pinned_count(tiles, p) == min(blocks, tiles * p.dn_nb)
    assert all(i[0] == "gate_up" for i in queue[:n_gu]) and all(i[0] == "down" for i in queue[n_gu:])
    every_down = [("down", z, b) for z in range(tiles) for b in range(p.dn_nb)]
    assert pinned == every_down[:len(pinned)] and queue[n_gu:] == every_down[len(pinned):]
    assert schedule(tiles, p) == queue[:n_gu] + every_down
    unpinned = type(p)(**{**p.__dict__, "pin": False})
    assert pinned_items(tiles, unpinned) == [] and stream_items(tiles, unpinned)[n_gu:] == every_down


def test_a_queue_within_the_grid_runs_on_distinct_blocks():
    """M = 1 pinned: 112 gate_up items on 132 blocks. A look-ahead would leave blocks that start late with nothing
    while early ones hold two; the kernel draws ahead only for a queue longer than the grid."""
    p = plan_moe_stream(SHAPES["tp8"], 1, 132, 232448, (4, 2), bulk=True, pin=True)
    n_items = len(stream_items(8, p))
    assert n_items == 112 and not looks_ahead(n_items, p.blocks)
    ahead, not_ahead = first_round(n_items, p.blocks, True), first_round(n_items, p.blocks, False)
    assert max(ahead) == 2 and sum(h > 0 for h in ahead) == 56
    assert max(not_ahead) == 1 and sum(not_ahead) == 112
    unpinned = plan_moe_stream(SHAPES["tp8"], 1, 132, 232448, (4, 2))
    assert looks_ahead(len(stream_items(8, unpinned)), unpinned.blocks)     # 224 items: the look-ahead stays


def test_align_tiles_twin():
    ids = np.array([[3, 1], [1, 0], [1, 2]] + [[1, 4]] * 7, np.int32)
    experts, pairs = align_tiles(ids)
    assert experts.tolist() == [0, 1, 1, 2, 3, 4]                       # expert 1 has 10 pairs: two tiles
    flat = pairs.reshape(-1)
    assert sorted(flat[flat >= 0].tolist()) == list(range(ids.size))
    for e, row in zip(experts, pairs):
        assert all(ids.reshape(-1)[p] == e for p in row if p >= 0)


@pytest.mark.parametrize("M, knobs", [(1, {}), (3, dict(gu_splits=2)), (9, dict(gu_warps=4, dn_tpw=2)),
                                      (17, dict(gu_warps=4, gu_tpw=2, gu_splits=1)),
                                      (1, dict(bulk=True, pin=True)), (5, dict(bulk=True, pin=True, dn_tpw=2))])
def test_simulated_schedule_equals_the_reference(M, knobs):
    """The twin runs every item of the ticket order on exactly the kernel's slice (n-tiles of its n-block, k of
    its split) and asserts a down item finds its tile's act complete and nothing is written twice."""
    rng = np.random.default_rng(M)
    E, H, I, topk = 6, 256, 128, 4
    packed = layout.repack_experts(random_experts(rng, E, H, I, 0.05))
    shape = MoEShape(H, I, E, topk, max_tokens=32)
    dn_tpw = knobs.pop("dn_tpw", None)
    p = plan_moe_stream(shape, M, 132, 232448, (4, 2), dn_tpw=dn_tpw, **knobs)
    assert p.gu_nb * p.warps * 2 * p.gu_tpw >= I // 8
    x = rng.standard_normal((M, H))
    ids = np.stack([rng.permutation(E)[:topk] for _ in range(M)]).astype(np.int32)
    w = rng.uniform(0.2, 1.0, (M, topk))
    shared = rng.standard_normal((M, H))
    got = simulate_stream(x, ids, w, packed, p, shared=shared)
    want = reference.moe_given_routing(x, ids, w, packed, shared=shared)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


def test_stream_default_is_the_measured_range():
    """The plan takes the streaming launch only where a device measured it faster in the step: tp 8 at 65 rows
    (8-warp blocks two an SM, k-split 4, 7 tile pairs a down warp) and above; 9..64 rows keep the two launches (the
    step with tree routing was slower streamed), and so does one row since moe_down_cols (two launches 23.5 us against
    the streaming launch's 26.9 on the H100; plugins/moe_down_cols.py COLS_MEASURED)."""
    tp8, tp1 = SHAPES["tp8"], SHAPES["tp1"]
    assert [M for M in range(1, 257) if stream_default("sm_90", tp8, M)] == list(range(65, 257))
    assert stream_default("sm_90a", tp8, 65) and not stream_default("sm_90", tp8, 17)
    assert stream_knobs("sm_90", tp8, 1) == {} and stream_knobs("sm_90", tp8, 66) == {}
    assert stream_knobs("sm_90", tp8, 65) == dict(gu_warps=8, gu_splits=4, blocks_per_sm=2, dn_tpw=7)
    assert stream_knobs("sm_90", tp8, 33) == {}
    assert not any(stream_default(arch, shape, M) for arch in ("sm_90", "sm_120", "sm_80") for shape in (tp1,)
                   for M in range(1, 257))
    assert not any(stream_default("sm_120", tp8, M) for M in range(1, 257))
    tiny = MoEShape(128, 512, 8, 2)                                     # short K too, but not measured
    assert not any(stream_default("sm_90", tiny, M) for M in range(1, 257))


@pytest.mark.parametrize("invariant", [False, True])
def test_measured_knobs_make_plans_that_fit(invariant):
    """Each measured range's knobs give a plan on the H200 at every M of the range; with the batch-invariant split
    (max_tokens' plan) the split stays and the knobs that no longer fit fall back to the plain plan."""
    shape = SHAPES["tp8"]
    fixed = plan_moe(shape, 256, 132, 232448, (4, 2)).gu_splits if invariant else None
    for first, last, knobs in STREAM_MEASURED[("sm_90", 7168, 256)]:
        for M in range(first, last + 1):
            gate_up = {k: v for k, v in knobs.items() if k.startswith("gu_") and not (fixed and k == "gu_splits")}
            base = plan_moe(shape, M, 132, 232448, (4, 2), **{"gu_splits": fixed, **gate_up})
            try:
                p = plan_moe_stream(shape, M, 132, 232448, (4, 2), 50 << 20, base=base,
                                    **{k: v for k, v in knobs.items() if not k.startswith("gu_")})
            except ValueError:
                assert invariant, (M, knobs)
                continue
            assert p.smem + STATIC_SMEM <= 232448 and (fixed is None or p.gu_splits == fixed)
            assert (p.bulk, p.pin) == (knobs.get("bulk", False), knobs.get("pin", False))
