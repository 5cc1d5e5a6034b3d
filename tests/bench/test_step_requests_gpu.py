"""`ddtree bench step --requests`'s captured union verify (bench/step_requests.py) on rank 0 of Kimi K2.6 tp 8 at real
width, 2 layers (a dense and an MoE layer), generated weights, R = 1 and 2 requests at context 256, budget 8:

    the graph's logits equal the uncaptured forward's bit for bit (the same plans: attention for the stated context)
    after new cache rows are written on the device, replay and eager agree again and differ from before: the graph
    reads the device caches (the row offsets alone are fixed per graph)
    R = 2: rewriting request 1's cache changes request 1's rows only (request 0's stay bitwise), and request 0's
    rows are its rows alone (R = 1) within bf16 rounding (the fast plan's GEMM splits follow the row count)
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
CONTEXT, BUDGET = 256, 8


@pytest.fixture(scope="module")
def rank():
    from ddtree.bench.step_requests import cache_rows
    from ddtree.bench.synthetic_rank import SyntheticRank
    from ddtree.builder.plan import make_plan
    from ddtree.model.presets import get_preset
    from ddtree.plugins.device import Gpu
    cfg, dcfg = get_preset("kimi-k2.6", 2)
    gpu = Gpu(0)
    r = SyntheticRank(gpu, cfg, dcfg, make_plan(cfg, dcfg, 8), 0, cache_rows([CONTEXT], [BUDGET]))
    r.fill_caches(CONTEXT)
    yield r
    gpu.free_all()


def test_the_captured_union_verify_is_the_uncaptured_one(rank):
    from ddtree.bench.step_requests import UnionVerify, request_caches, set_routing
    from ddtree.plugins import randfill as rf
    gpu, caches = rank.gpu, request_caches(rank, 2)
    rank.ops.attention_context = CONTEXT
    got = {}
    for R in (1, 2):
        v = UnionVerify(rank, caches[:R], CONTEXT, BUDGET)
        distinct = set_routing(rank, v, "uniform", None)
        assert distinct["min"] >= rank.config.num_experts_per_tok
        want = v.eager()
        assert np.isfinite(want).all() and want.shape == (9 * R, rank.lay.vocab_stop - rank.lay.vocab_start)
        graph = v.capture()
        gpu.replay(graph)
        gpu.sync()
        replayed = v.read_logits()
        assert (replayed == want).all(), f"R {R}: graph vs eager max |diff| {np.abs(replayed - want).max():.3e}"
        got[R] = want
        rf.fill_device(gpu, caches[R - 1].dev.buf, 99 + R, rf.ACT_BF16)       # the last request's cache rewritten
        again = v.eager()
        gpu.replay(graph)
        gpu.sync()
        assert (v.read_logits() == again).all(), f"R {R}: after new cache rows, graph vs eager differ"
        last = slice(9 * (R - 1), 9 * R)
        assert not (again[last] == want[last]).all(), f"R {R}: new cache rows did not change the last request's rows"
        assert (again[: 9 * (R - 1)] == want[: 9 * (R - 1)]).all(), "another request's cache changed request 0's rows"
        rank.fill_caches(CONTEXT)                                             # request 0's first rows again
    alone, union = got[1], got[2]
    scale = np.abs(alone).max()
    diff = np.abs(union[:9] - alone).max()
    assert diff <= 3e-2 * scale, f"request 0 in the union vs alone: {diff:.3e} of {scale:.3e}"
