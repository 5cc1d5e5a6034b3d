"""GPU tests of the live mask inside the routing kernels (issue 53: kernels/route_common.cuh live_rows in router.cu's
fused router and moe.cu's moe_route), against the three launches moe_live made before it: the router unmasked,
route_live (here its numpy twin, plugins/prune_ops.py route_live_twin, on the host), then moe_route's alignment of
the rewritten routing (old_live_route).
  routing  the ids / weights the experts read bit for bit the twin's on the unmasked routing, the routed ids the
           unmasked ids, the tile lists right (check_tiles) and the old path's (the same tiles in the same order,
           each expert's pairs as a set: slots within an expert go by atomics); the given routing left as given;
           fused (folded and not: a warp a token, route_block, route_rows; one token block and two) and unfused
           (router GEMM + moe_route), computed and given routing, M = 1, 9, 17, 33, 65; random masks with the root
           marked dead (it stays live), all live, all dead
  output   the experts over the masked routing bit for bit the old path's (a pair's rows do not depend on its
           slot), a dead row's output the shared expert's bit for bit (its routed part is 0)
Run: python3 -m pytest -q tests/plugins/test_route_live_gpu.py"""
import numpy as np
import pytest

from ddtree.model.bf16 import f32_to_bf16
from ddtree.plugins import layout, randfill
from ddtree.plugins.prune_ops import route_live_twin
from tests.plugins.test_prune_ops import random_experts
from tests.plugins.test_router_gpu import MOE_SHAPES, check_tiles, moe_for

pytestmark = pytest.mark.gpu


def masks(rng, M: int) -> list[np.ndarray]:
    half = (rng.random(M) < 0.5).astype(np.int32)
    half[0] = 0                                            # the root is live whatever the mask says
    return [half, np.ones(M, np.int32), np.zeros(M, np.int32)]


def given_routing(rng, M: int, E: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.stack([rng.permutation(E)[:k] for _ in range(M)]).astype(np.int32)
    return ids, rng.uniform(0.1, 1.0, (M, k)).astype(np.float32)


def old_live_route(gpu, moe, x, M, live, given=None):
    """The router unmasked (or the given routing aligned), route_live_twin on the host, moe_route's alignment of
    its output -> (ids, weights) device buffers the experts read, the routed ids [M, k]."""
    if given is None:
        moe.route(x, M)
        gpu.sync()
        ids, w = moe.topk_ids.numpy()[:M], moe.topk_w.numpy()[:M]
    else:
        ids, w = given
    new_ids, new_w, routed = route_live_twin(ids, w, live)
    d_ids, d_w = gpu.upload(new_ids), gpu.upload(new_w)
    moe.launch_route(None, M, d_ids, d_w, None)
    gpu.sync()
    return d_ids, d_w, routed


def tiles_of(moe) -> tuple:
    """(tile count, each tile's expert in order, each expert's pairs as a set)."""
    n = int(moe.num_tiles.numpy()[0])
    experts, pairs = moe.tile_expert.numpy()[:n], moe.tile_pairs.numpy()[:n]
    by_expert = {}
    for e, row in zip(experts.tolist(), pairs):
        by_expert.setdefault(e, set()).update(row[row >= 0].tolist())
    return n, experts.tolist(), by_expert


def new_live_route(gpu, moe, x, M, live, given=None):
    """The masked routing launch with its outputs poisoned first -> (ids, weights) device buffers it returned,
    routed ids [M, k]."""
    k = moe.shape.topk
    routed = gpu.alloc((M, k), np.int32)
    for a in (moe.topk_ids, moe.topk_w, moe.tile_expert, moe.tile_pairs, routed):
        gpu.memset(a, 0xFF)
    d_live = gpu.upload(live)
    if given is None:
        out = moe.route(x, M, live=d_live, routed_ids=routed)
    else:
        out = moe.route_given(x, M, *given, live=d_live, routed_ids=routed)
    gpu.sync()
    return out[0], out[1], routed.numpy()


@pytest.mark.parametrize("given", [False, True], ids=["routed", "given"])
@pytest.mark.parametrize("plan", ["fused", "folded", "unfused"])
@pytest.mark.parametrize("M", [1, 9, 17, 33, 65])
def test_live_routing_is_route_live_twin_then_the_alignment(gpu, M, plan, given):
    moe = moe_for(gpu, "kimi")
    E, k, H = moe.shape.experts, moe.shape.topk, MOE_SHAPES["kimi"]["hidden"]
    if plan == "unfused":
        moe.fused_router = False
    else:
        planned = moe.router_fused.plan(M)
        try:
            p = moe.router_fused.override(M, fold=plan == "folded", warps=planned.warps, tiles=planned.tiles,
                                          splits=planned.splits)
        except ValueError as exc:
            pytest.skip(f"no {plan} plan at M = {M} on {gpu.arch}: {exc}")
        assert p.fold == (plan == "folded")
    x = gpu.upload(randfill.hash_array((M, H), np.uint16, 1002 + M, randfill.ACT_BF16))
    rng = np.random.default_rng(M)
    host_given = given_routing(rng, M, E, k) if given else None
    dev_given = tuple(gpu.upload(a) for a in host_given) if given else None
    for live in masks(rng, M):
        want_ids, want_w, want_routed = old_live_route(gpu, moe, x, M, live, host_given)
        want_ids, want_w, want_tiles = want_ids.numpy(), want_w.numpy(), tiles_of(moe)
        ids, w, routed = new_live_route(gpu, moe, x, M, live, dev_given)
        ids, w = ids.numpy()[:M], w.numpy()[:M]
        np.testing.assert_array_equal(ids, want_ids, err_msg=f"live {live.tolist()}")
        np.testing.assert_array_equal(w.view(np.uint32), want_w.view(np.uint32))
        np.testing.assert_array_equal(routed, want_routed)
        check_tiles({"num_tiles": moe.num_tiles, "tile_expert": moe.tile_expert, "tile_pairs": moe.tile_pairs},
                    ids, E)
        assert tiles_of(moe) == want_tiles
        dead = live == 0
        dead[0] = False
        assert set(tiles_of(moe)[1]) == set(routed[~dead].reshape(-1).tolist())   # no expert only a dead row wanted
        if given:                                          # the benchmark's buffers stay as given
            np.testing.assert_array_equal(dev_given[0].numpy(), host_given[0])
            np.testing.assert_array_equal(dev_given[1].numpy(), host_given[1])


@pytest.mark.parametrize("fused_router", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("given", [False, True], ids=["routed", "given"])
def test_live_moe_output_is_the_three_launch_paths(gpu, given, fused_router):
    from ddtree.plugins.moe import FusedMoE, MoEShape
    rng = np.random.default_rng(11)
    E, H, I, k = 8, 128, 64, 2
    packed = random_experts(rng, E, H, I)                  # repacked (layout.repack_experts)
    router = f32_to_bf16(rng.standard_normal((E, H)).astype(np.float32) * 0.1)
    bias = (rng.standard_normal(E) * 0.1).astype(np.float32)
    moe = FusedMoE(gpu, MoEShape(H, I, E, k, scaling=2.5, max_tokens=64), {key: gpu.upload(v) for key, v in
                   packed.items()}, router=gpu.upload(layout.tile_bf16(router)), bias=gpu.upload(bias))
    moe.fused_router = fused_router
    for M in (1, 9, 17, 33):
        x = gpu.upload(f32_to_bf16(rng.standard_normal((M, H)).astype(np.float32)))
        shared = f32_to_bf16(rng.standard_normal((M, H)).astype(np.float32))
        d_shared = gpu.upload(shared)
        host_given = given_routing(rng, M, E, k) if given else None
        dev_given = tuple(gpu.upload(a) for a in host_given) if given else None
        for live in masks(rng, M):
            outs = []
            for route in (old_live_route, new_live_route):
                ids, w, _ = route(gpu, moe, x, M, live, dev_given if route is new_live_route else host_given)
                out = gpu.alloc((M, H), np.uint16)
                gpu.memset(out, 0xFF)
                moe.experts(x, out, M, ids, w, d_shared)
                gpu.sync()
                outs.append(out.numpy())
            np.testing.assert_array_equal(outs[1], outs[0], err_msg=f"M = {M}, live {live.tolist()}")
            dead = live == 0
            dead[0] = False
            np.testing.assert_array_equal(outs[1][dead], shared[dead])            # 0 x an expert adds nothing
