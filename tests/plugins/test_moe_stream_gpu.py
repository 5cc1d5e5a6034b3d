"""GPU tests of the streaming MoE launch (kernels/moe_stream.cuh: gate_up -> down in one persistent kernel) at the
tp 8 and tp 1 per-rank shapes (moe_cases), M 1..65: inside a captured graph replayed 3 times, bitwise equal to the
two launches (moe_gate_up + moe_down: the same sums in the same order at the same gate_up k-split) and within the
MoE error rule of the float64 reference; forced plans (blocks per SM, down tile pairs, L2 prefetch, k-splits, bulk
copies, pinned down items, deeper rings);
three back-to-back calls in one graph. Outputs are poisoned with NaN before each replay."""
import numpy as np
import pytest
from test_kernels_gpu import assert_close, moe_case  # noqa: F401  (moe_case: the module fixture of both paths)

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16

pytestmark = pytest.mark.gpu
STREAM_MS = [1, 2, 3, 8, 16, 17, 33, 64, 65]
EXPERT_KEYS = ("gate_up", "gate_up_scale", "down", "down_scale")


def make_moe(gpu, c, streaming, **kw):
    from ddtree.plugins.moe import FusedMoE
    return FusedMoE(gpu, c["moe"].shape, {k: c["dev"][k] for k in EXPERT_KEYS}, streaming=streaming, **kw)


def graph_out(gpu, moe, c, M, ids, w, shared, replays=3):
    """run() captured in a graph (route kernel + experts), replayed `replays` times on a poisoned output; every
    replay must give the same bits. Returns the output rows as float."""
    moe.run(c["dev"]["x"], c["out"], M, shared=shared, topk=(ids, w))       # compile, smem limits: outside capture
    gpu.sync()
    graph = gpu.capture(lambda s: moe.run(c["dev"]["x"], c["out"], M, shared=shared, topk=(ids, w), stream=s))
    got = None
    for _ in range(replays):
        gpu.memset(c["out"], 0xFF)
        gpu.replay(graph)
        y = bf16_to_f32(c["out"].numpy()[:M])
        if got is not None:
            np.testing.assert_array_equal(y, got)
        got = y
    return got


@pytest.fixture(scope="module")
def paths(gpu, moe_case):
    return make_moe(gpu, moe_case, False), make_moe(gpu, moe_case, True)


@pytest.mark.parametrize("M", STREAM_MS)
def test_stream_equals_two_launches_in_a_graph(gpu, moe_case, paths, M):
    c, (two, stream) = moe_case, paths
    assert stream.uses_stream(M) and not two.uses_stream(M)
    with_shared = M in (3, 17, 64)
    shared = c["dev"]["shared"] if with_shared else None
    ids, w = gpu.upload(c["ids"][:M]), gpu.upload(c["w"][:M])
    two.override(M, gu_splits=stream.stream_plan(M).gu_splits)     # the sums' order: the gate_up k-split alone
    y_two = graph_out(gpu, two, c, M, ids, w, shared, replays=1)
    y = graph_out(gpu, stream, c, M, ids, w, shared)
    ref = c["y_ref"][:M] + (c["shared_ref"][:M] if with_shared else 0.0)
    assert_close(y, ref, what=f"moe stream {c['name']} M={M}")
    np.testing.assert_array_equal(y, y_two, err_msg=f"stream != two launches ({c['name']} M={M})")


STREAM_VARIANTS = {
    "w8_two_blocks_per_sm": dict(gu_warps=8, gu_splits=4, blocks_per_sm=2),
    "down_tpw2": dict(dn_tpw=2),
    "down_tpw14": dict(dn_tpw=14),
    "no_prefetch": dict(prefetch=0),
    "prefetch_always": dict(prefetch=1 << 20),
    "splits4_w8": dict(gu_splits=4, gu_warps=8),
    "ring_6x1": dict(gu_ring=(6, 1)),
    "bulk": dict(bulk=True),                                        # slots as bulk copies on mbarriers
    "bulk_pin_s14": dict(bulk=True, pin=True, gu_splits=14, dn_tpw=1),   # + block b's down item pinned (M = 1)
    "bulk_pin_w8_tpw2": dict(bulk=True, pin=True, gu_splits=14, gu_warps=8, dn_tpw=2),
    "bulk_pin_r3_s14": dict(bulk=True, pin=True, gu_ring=(3, 2), gu_splits=14, dn_tpw=1),
    "ring_5x2_s14": dict(gu_ring=(5, 2), gu_splits=14),
    "bulk_ring_5x2_s14": dict(bulk=True, gu_ring=(5, 2), gu_splits=14),
}


@pytest.mark.parametrize("variant", sorted(STREAM_VARIANTS))
def test_stream_forced_plans(gpu, moe_case, variant):
    c = moe_case
    stream, two = make_moe(gpu, c, None), make_moe(gpu, c, False)
    for M in (1, 17, 64):
        knobs = STREAM_VARIANTS[variant]
        try:
            p = stream.override_stream(M, **knobs)
        except ValueError as exc:                                   # e.g. two 8-warp blocks on a 99 KB sm_120
            if c["name"] == "tp1" and "slots a warp exceed" in str(exc):   # inter 2048: a down item is 16 slots
                pytest.skip(f"{variant}: {exc}")
            assert gpu.smem_optin < 200 * 1024, exc
            pytest.skip(f"{variant}: {exc}")
        two.override(M, **{k: v for k, v in knobs.items() if k.startswith("gu_")})
        assert stream.uses_stream(M) and two.plan(M).gu_splits == p.gu_splits
        ids, w = gpu.upload(c["ids"][:M]), gpu.upload(c["w"][:M])
        y = graph_out(gpu, stream, c, M, ids, w, c["dev"]["shared"])
        assert_close(y, c["y_ref"][:M] + c["shared_ref"][:M], what=f"moe stream {c['name']} {variant} M={M}")
        y_two = graph_out(gpu, two, c, M, ids, w, c["dev"]["shared"], replays=1)
        np.testing.assert_array_equal(y, y_two, err_msg=f"stream {variant} != two launches (M={M})")


def back_to_back(gpu, c, moe, calls, rows: int, replays: int = 3):
    """calls [(first token, M)] in one graph on two outputs of `rows` rows in turn (PDL: each launch overlaps the
    previous one's tail; call i writes output i % 2), replayed on NaN-poisoned outputs -> each replay's outputs as
    float."""
    H = c["dev"]["x"].shape[1]
    outs = [gpu.alloc((rows, H), np.uint16) for _ in range(2)]
    routes = [(gpu.upload(c["ids"][t0:t0 + m]), gpu.upload(c["w"][t0:t0 + m])) for t0, m in calls]
    for i, (t0, m) in enumerate(calls):
        moe.run(c["dev"]["x"].view(t0 * H, (m, H)), outs[i % 2], m, topk=routes[i])
    gpu.sync()

    def chain(stream):
        for i, (t0, m) in enumerate(calls):
            moe.run(c["dev"]["x"].view(t0 * H, (m, H)), outs[i % 2], m, topk=routes[i], stream=stream)
    graph = gpu.capture(chain)
    got = []
    for _ in range(replays):
        for o in outs:
            gpu.memset(o, 0xFF)
        gpu.replay(graph)
        got.append([bf16_to_f32(o.numpy()) for o in outs])
    return got


def test_stream_graph_back_to_back(gpu, moe_case):
    """Three streaming calls in one graph (the queue and ready counts reset by each launch's last block): different
    M, shared workspaces, the third rewriting the first's output."""
    c = moe_case
    moe = make_moe(gpu, c, True)
    for got in back_to_back(gpu, c, moe, [(0, 16), (16, 3), (19, 1)], rows=16):
        assert_close(got[1][:3], c["y_ref"][16:19], what=f"moe stream {c['name']} graph call 2")
        assert np.isnan(got[1][3:]).all()
        assert_close(got[0][:1], c["y_ref"][19:20], what=f"moe stream {c['name']} graph call 3")
        assert_close(got[0][1:], c["y_ref"][1:16], what=f"moe stream {c['name']} graph call 1 (rows call 3 kept)")
    assert not moe.queue.numpy().any() and not moe.ready.numpy().any()      # reset for the next launch


def routed_case(gpu, M: int, seed: int, bias_range: float = 0.0, E: int = 64, H: int = 7168, I: int = 256) -> tuple:
    """(weights, router, bias, x) of a routed MoE at tp 8's per-rank expert shape on E experts: random INT4 experts
    (randfill streams 900..903), a [E, H] router in the tiled layout, a bias uniform in +-bias_range, x [M, H]."""
    from ddtree.plugins import layout, randfill
    specs = {"gate_up": ((E, I // 16, H // 64, 2, 32, 4), np.int32, randfill.INT4_WORDS),
             "gate_up_scale": ((E, I // 16, H // 64, 2, 8, 4), np.uint16, randfill.SCALES_BF16),
             "down": ((E, H // 32, I // 64, 2, 32, 4), np.int32, randfill.INT4_WORDS),
             "down_scale": ((E, H // 32, I // 64, 2, 8, 4), np.uint16, randfill.SCALES_BF16)}
    weights = {}
    for i, (k, (shp, dt, preset)) in enumerate(specs.items()):
        weights[k] = gpu.alloc(shp, dt)
        randfill.fill_device(gpu, weights[k], 900 + i, preset)
    rng = np.random.default_rng(seed)
    router = gpu.upload(layout.tile_bf16(f32_to_bf16(rng.standard_normal((E, H)) * 0.02)))
    bias = gpu.upload(rng.uniform(-bias_range, bias_range, E).astype(np.float32) if bias_range else
                      np.zeros(E, np.float32))
    x = gpu.upload(f32_to_bf16((rng.standard_normal((M, H)) * 0.5).astype(np.float32)))
    return weights, router, bias, x


def test_stream_routed_with_the_fused_router(gpu):
    """The engine's order: the fused router (plugins/router.py) fills the tile lists, then the streaming launch;
    equal bitwise to the two launches after the same router at the same gate_up k-split."""
    from ddtree.plugins.moe import FusedMoE, MoEShape
    H, I, E, M = 7168, 256, 64, 17
    weights, router, bias, x = routed_case(gpu, M, 5)
    shape = MoEShape(H, I, E, 8, scaling=2.5, max_tokens=64)
    outs, splits = [], None
    for streaming in (True, False):
        moe = FusedMoE(gpu, shape, weights, router=router, bias=bias, streaming=streaming)
        if streaming:                       # the measured plan may take another k-split (tp 8 shape: 4 at 17 rows)
            splits = moe.stream_plan(M).gu_splits
        else:
            moe.override(M, gu_splits=splits)
        out = gpu.alloc((M, H), np.uint16)
        moe.run(x, out, M)
        gpu.sync()
        graph = gpu.capture(lambda s: moe.run(x, out, M, stream=s))
        for _ in range(3):
            gpu.memset(out, 0xFF)
            gpu.replay(graph)
            outs.append(bf16_to_f32(out.numpy()))
    assert np.isfinite(outs[0]).all()
    for y in outs[1:]:
        np.testing.assert_array_equal(y, outs[0])
