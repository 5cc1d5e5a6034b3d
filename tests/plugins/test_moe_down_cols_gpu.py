"""GPU tests of moe_down_cols (kernels/moe_down_cols.cuh: the down projection + combine by output columns, y in
shared memory) at the tp 8 and tp 1 per-rank shapes (moe_cases) where its plan fits: inside a captured graph
replayed 3 times on a NaN-poisoned output, bitwise equal to moe_gate_up + moe_down (the same sums in the same order
at one down k-split) and within the MoE error rule of the float64 reference; forced plans (warps, tile pairs a
block, rings); many rows on few experts (several tiles an expert); after the fused router; back to back in a graph."""
import numpy as np
import pytest
from test_kernels_gpu import assert_close, moe_case  # noqa: F401, F811  (moe_case: the module fixture of both shapes)
from test_moe_stream_gpu import EXPERT_KEYS, back_to_back, graph_out, routed_case

pytestmark = pytest.mark.gpu
COLS_MS = [1, 2, 3, 5, 8, 9, 12, 16, 17]
VARIANTS = {"default": {}, "w16_upb2_r2x2": dict(warps=16, upb=2, ring=(2, 2)),
            "w8_upb1_r4x2": dict(warps=8, upb=1, ring=(4, 2)), "w4_upb3_r2x4": dict(warps=4, upb=3, ring=(2, 4)),
            "w8_upb7": dict(warps=8, upb=7)}


def make_moe(gpu, c, down_cols, **kw):
    from ddtree.plugins.moe import FusedMoE
    return FusedMoE(gpu, c["moe"].shape, {k: c["dev"][k] for k in EXPERT_KEYS}, streaming=False, down_cols=down_cols,
                    **kw)


@pytest.fixture(scope="module")
def pair(gpu, moe_case):
    return make_moe(gpu, moe_case, False), make_moe(gpu, moe_case, None)


def fits(moe, M, **knobs):
    try:
        return moe.override_cols(M, **knobs)
    except ValueError as exc:
        assert "shared memory" in str(exc), exc
        pytest.skip(f"M = {M}: {exc}")


@pytest.mark.parametrize("M", COLS_MS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cols_equal_moe_down_in_a_graph(gpu, moe_case, pair, M, variant):
    c, (two, cols) = moe_case, pair
    if variant != "default" and M not in (1, 9, 17):
        pytest.skip("forced plans at 1, 9, 17 rows")
    fits(cols, M, **VARIANTS[variant])
    assert cols.uses_down_cols(M) and not two.uses_down_cols(M) and cols.plan(M) == two.plan(M)
    with_shared = M in (3, 9, 17)
    shared = c["dev"]["shared"] if with_shared else None
    ids, w = gpu.upload(c["ids"][:M]), gpu.upload(c["w"][:M])
    y_two = graph_out(gpu, two, c, M, ids, w, shared, replays=1)
    y = graph_out(gpu, cols, c, M, ids, w, shared)
    ref = c["y_ref"][:M] + (c["shared_ref"][:M] if with_shared else 0.0)
    assert_close(y, ref, what=f"moe down_cols {c['name']} {variant} M={M}")
    np.testing.assert_array_equal(y, y_two, err_msg=f"down_cols {variant} != moe_down ({c['name']} M={M})")


@pytest.mark.parametrize("M", [1, 9, 17])
@pytest.mark.parametrize("down_cols", [None, False])
def test_down_weights_prefetched_by_gate_up_change_no_bit(gpu, moe_case, M, down_cols):
    """gate_up asking L2 for the down weights (down_prefetch: every launch here) is a hint: the output is the
    no-prefetch launches' bit for bit (moe_down_cols where it runs at M, else moe_down), within the reference."""
    c = moe_case
    plain, fetching = make_moe(gpu, c, down_cols), make_moe(gpu, c, down_cols, down_prefetch=1 << 20)
    assert fetching.uses_down_cols(M) == plain.uses_down_cols(M) and fetching.plan(M) == plain.plan(M)
    shared = c["dev"]["shared"]
    ids, w = gpu.upload(c["ids"][:M]), gpu.upload(c["w"][:M])
    y_plain = graph_out(gpu, plain, c, M, ids, w, shared, replays=1)
    y = graph_out(gpu, fetching, c, M, ids, w, shared)
    assert_close(y, c["y_ref"][:M] + c["shared_ref"][:M], what=f"moe, down prefetched, {c['name']} M={M}")
    np.testing.assert_array_equal(y, y_plain, err_msg=f"down prefetch changed the output ({c['name']} M={M})")


def test_down_prefetch_must_not_be_negative(gpu, moe_case):
    with pytest.raises(ValueError, match="down_prefetch = -1"):
        make_moe(gpu, moe_case, None, down_prefetch=-1)


def test_cols_with_several_tiles_an_expert(gpu, moe_case, pair):
    """17 rows on the same 8 experts: 17 pairs an expert, three tiles each (the last one padded)."""
    c, (two, cols) = moe_case, pair
    M = 17
    fits(cols, M)
    ids = np.tile(np.arange(8, dtype=np.int32), (M, 1))
    w = np.tile(np.linspace(0.2, 0.5, 8, dtype=np.float32), (M, 1))
    dids, dw = gpu.upload(ids), gpu.upload(w)
    y_two = graph_out(gpu, two, c, M, dids, dw, c["dev"]["shared"], replays=1)
    y = graph_out(gpu, cols, c, M, dids, dw, c["dev"]["shared"])
    np.testing.assert_array_equal(y, y_two)
    assert np.isfinite(y).all()


def test_cols_graph_back_to_back(gpu, moe_case):
    """Three calls in one graph (PDL: each overlaps the previous one's tail), different M, the third rewriting the
    first's output: each equals its rows of the reference."""
    c = moe_case
    moe = make_moe(gpu, c, True)
    calls = [(0, 9), (9, 3), (12, 1)]                             # (first token, M)
    for _, m in calls:
        fits(moe, m)
    for got in back_to_back(gpu, c, moe, calls, rows=9):
        assert_close(got[1][:3], c["y_ref"][9:12], what=f"moe down_cols {c['name']} graph call 2")
        assert np.isnan(got[1][3:]).all()
        assert_close(got[0][:1], c["y_ref"][12:13], what=f"moe down_cols {c['name']} graph call 3")
        assert_close(got[0][1:], c["y_ref"][1:9], what=f"moe down_cols {c['name']} graph call 1 (rows call 3 kept)")


def test_cols_after_the_fused_router(gpu):
    """The engine's order: the fused router fills the tile lists, then gate_up and moe_down_cols; bitwise the two
    launches with moe_down after the same router."""
    from ddtree.model.bf16 import bf16_to_f32
    from ddtree.plugins.moe import FusedMoE, MoEShape
    H, I, E, M = 7168, 256, 64, 13
    weights, router, bias, x = routed_case(gpu, M, 7, bias_range=0.01)
    shape = MoEShape(H, I, E, 8, scaling=2.5, max_tokens=32)
    outs = []
    for down_cols in (False, True):
        moe = FusedMoE(gpu, shape, weights, router=router, bias=bias, streaming=False, down_cols=down_cols)
        out = gpu.alloc((M, H), np.uint16)
        moe.run(x, out, M)
        gpu.sync()
        graph = gpu.capture(lambda s: moe.run(x, out, M, stream=s))
        gpu.memset(out, 0xFF)
        gpu.replay(graph)
        outs.append(bf16_to_f32(out.numpy()))
    assert np.isfinite(outs[0]).all()
    np.testing.assert_array_equal(outs[1], outs[0])
