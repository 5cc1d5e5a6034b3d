"""The union verify (issue 51): Rq requests' trees in ONE target forward, each request's rows seeing only its own
cache and ancestors (description/layers.py decoder_layer(requests=Rq), opset.py REQUEST_OPS, EngineExecutor
.verify_requests). The independent reference is each request's own target_forward on a copy of its cache.

Why 1e-12 and not bitwise on the executor: the union's row-wise ops (linear, MoE, norms) run over all Rq requests'
rows at once, and OpenBLAS picks its dgemm kernel by the row count (a 1-row product is a gemv; small products
block differently), so a row's dot products may sum in another order than in its request's own call: the logits
differ at ~1e-15 relative (float64). The per-request ops themselves (append, attention) are bitwise each request's
own op (test_request_ops_are_each_requests_own_op)."""
import numpy as np
import pytest

from ddtree.backends.meter import MeterOps, meter_call
from ddtree.backends.meter_requests import request_dims
from ddtree.backends.numpy_backend import NumpyOps
from ddtree.backends.onnx_backend import OnnxOps
from ddtree.builder.build import build_engine
from ddtree.builder.plan import make_plan
from ddtree.builder.weights import rank_tensor_specs
from ddtree.data import tiny_model_dirs
from ddtree.description import layers, stack
from ddtree.description.opset import MlaSpec, RankLayout
from ddtree.model.presets import get_preset
from ddtree.reference.model import causal_visible
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.tree.build import pack_visibility

TAPS = (1, 2)
REQUESTS = [(7, 5), (30, 17), (3, 40)]          # (prompt rows in the cache, tree nodes): 1 and 2 mask words


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def executor(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"union{request.param}") / "engine"
    return EngineExecutor(build_engine(*tiny_model_dirs(), request.param, [], out, graphs=False,
                                       kernels=False)["engine"])


def tree_visible(rng, n: int) -> np.ndarray:
    """A random tree's ancestor-or-self mask [n, n] (parents[i] < i)."""
    vis = np.eye(n, dtype=bool)
    for i in range(1, n):
        vis[i] |= vis[int(rng.integers(0, i))]
    return vis


def verify_calls(ex, seed: int = 0) -> list[tuple]:
    """REQUESTS as target_forward calls on prefilled caches: (ids, pos, visible, cache, taps)."""
    rng, V = np.random.default_rng(seed), ex.config.vocab_size
    calls = []
    for prompt, n in REQUESTS:
        cache = ex.new_target_cache(16, 512)                 # small: the union verify grows each cache itself
        ex.target_forward(rng.integers(0, V, prompt), np.arange(prompt), causal_visible(0, prompt), cache)
        visible = np.concatenate([np.ones((n, prompt), bool), tree_visible(rng, n)], axis=1)
        calls.append((rng.integers(0, V, n), prompt + rng.integers(0, 6, n), visible, cache, TAPS))
    return calls


def close(got, want) -> bool:
    return np.allclose(got, want, rtol=0, atol=1e-12 * max(1.0, np.abs(want).max()))


def test_the_union_forward_is_each_requests_own_forward(executor):
    calls = verify_calls(executor)
    alone = []
    for ids, pos, visible, cache, taps in calls:
        own = cache.copy()
        alone.append((executor.target_forward(ids, pos, visible, own, taps), own))
    layer_calls, run = [], executor.run
    executor.run = lambda kind, *a, **k: (layer_calls.append(kind), run(kind, *a, **k))[1]
    try:
        got = executor.verify_requests(calls)
    finally:
        executor.run = run
    assert layer_calls.count("dense_layer") + layer_calls.count("moe_layer") == executor.config.num_hidden_layers
    for (logits, tapped), ((want, want_taps), own), (_, _, _, cache, _) in zip(got, alone, calls):
        assert logits.shape == want.shape and close(logits, want)
        assert set(tapped) == set(TAPS) and all(close(tapped[L], want_taps[L]) for L in TAPS)
        assert cache.length == own.length
        assert all(close(cache.entries(L), own.entries(L)) for L in range(executor.config.num_hidden_layers))


def test_a_request_sees_only_its_own_cache(executor):
    """Request 0's cache prefix changed: its rows move, the other requests' rows stay (to 1e-12: request 0's rows
    route to other experts, which changes the row counts of the MoE's per-expert products, hence BLAS's order)."""
    first, second = verify_calls(executor, seed=3), verify_calls(executor, seed=3)
    for L in range(executor.config.num_hidden_layers):
        for rank in second[0][3].layers:
            rank[L][:4] += 0.5
    a, b = executor.verify_requests(first), executor.verify_requests(second)
    assert np.abs(a[0][0] - b[0][0]).max() > 1e-3
    for i in (1, 2):
        assert close(a[i][0], b[i][0]) and all(close(a[i][1][L], b[i][1][L]) for L in TAPS)


def test_request_ops_are_each_requests_own_op():
    """NumpyOps' request ops == the one-request ops on each request's span, bitwise; bad spans and a mask of the
    wrong request's shape are refused."""
    rng = np.random.default_rng(5)
    ops = NumpyOps({}, RankLayout(0, 1, 0, 64, 0, 4, 0, 32))
    spec, R, Dr = MlaSpec(3, 16, 8, 4, 8, 0.3), 16, 4
    lens, rows = [9, 0, 33], [5, 40, 2]
    off = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
    q = int(off[-1])
    caches = [rng.standard_normal((T + n + 3, R + Dr)) for T, n in zip(lens, rows)]
    own = [c.copy() for c in caches]
    c_kv, k_pe = rng.standard_normal((q, R)), rng.standard_normal((q, Dr))
    out = ops.kv_append_requests(tuple(caches), np.array(lens, np.int32), off, c_kv, k_pe)
    for c, o, T, a, b in zip(out, own, lens, off[:-1], off[1:]):
        assert (c == ops.kv_append(o, np.array([T]), c_kv[a:b], k_pe[a:b])).all()
    q_lat, q_rope = rng.standard_normal((q, 3, R)), rng.standard_normal((q, 3, Dr))
    masks = tuple(pack_visibility(tree_visible(rng, n)).view(np.int32) for n in rows)     # 1, 2 and 1 words
    got = ops.mla_tree_attention_requests(q_lat, q_rope, out, np.array(lens, np.int32), off, masks, spec)
    want = np.concatenate([ops.mla_tree_attention(q_lat[a:b], q_rope[a:b], c, np.array([T]), m, spec)
                           for c, T, a, b, m in zip(out, lens, off[:-1], off[1:], masks)])
    assert got.shape == (q, 3, R) and (got == want).all()
    with pytest.raises(ValueError, match="row_offsets"):
        ops.mla_tree_attention_requests(q_lat, q_rope, out, np.array(lens, np.int32), off[::-1], masks, spec)
    with pytest.raises(ValueError, match=r"tree_mask.0 must be \[5, 1\]"):                # another request's mask
        ops.mla_tree_attention_requests(q_lat, q_rope, out, np.array(lens, np.int32), off, masks[::-1], spec)


@pytest.fixture(scope="module")
def kimi_tp8():
    cfg, dcfg = get_preset("kimi-k2.6", layers=3)
    plan = make_plan(cfg, dcfg, 8)
    return cfg, plan, rank_tensor_specs(plan)


def test_the_meter_reads_each_requests_own_cache_prefix(kimi_tp8):
    """Kimi rank 0, two requests (4096 cached + 9 nodes, 100 + 17): one attention record per request, each the
    one-request attention's bytes and FLOPs at that request's length; the row-wise ops count the union rows once."""
    cfg, plan, specs = kimi_tp8
    lay = RankLayout.from_plan(plan.to_dict(), 0)
    reqs = [(4096, 9), (100, 17)]
    union = MeterOps(lay, specs, {"q": 26, "S": 4200, **request_dims(reqs)})
    recs = meter_call(union, "moe_layer", layers.decoder_layer, cfg, 1, plan.moe_inter, 2)
    attn = [r for r in recs if r.op == "mla_tree_attention_requests"]
    assert [r.detail["request"] for r in attn] == [0, 1]
    for rec, (T, q) in zip(attn, reqs):
        alone = MeterOps(lay, specs, {"q": q, "T": T, "S": 4200, "W": 1})
        one = next(r for r in meter_call(alone, "moe_layer", layers.decoder_layer, cfg, 1, plan.moe_inter)
                   if r.op == "mla_tree_attention")
        assert (rec.read, rec.written, rec.flops, rec.kernels) == (one.read, one.written, one.flops, one.kernels)
        assert rec.read >= (T + q) * 576 * 2 and rec.read < (T + q + 1) * 576 * 2 + q * 8 * 576 * 2 + 64
    appends = [r for r in recs if r.op == "kv_append_requests"]
    assert [r.written for r in appends] == [q * 576 * 2 for _, q in reqs]
    router = [r for r in recs if r.op == "moe.router"]                  # row-wise: once, over the union's 26 rows
    assert len(router) == 1 and router[0].flops == 2 * 26 * 384 * 7168
    with pytest.raises(ValueError, match="requests"):
        meter_call(MeterOps(lay, specs, {"q": 25, "S": 4200, **request_dims(reqs)}), "moe_layer",
                   layers.decoder_layer, cfg, 1, plan.moe_inter, 2)


def test_one_request_is_todays_layer_call(kimi_tp8):
    """requests=1 (the default) is the layer call of today: the same args to run, and no request op in it."""
    cfg, plan, specs = kimi_tp8
    seen = []

    def run(kind, fn, args, feeds, layer=None):
        seen.append(args)
        return {"h": None, "h_out": None, "logits": None}

    stack.target_forward(run, cfg, plan.moe_inter, {"ids": 0, "pos": 0, "cache_len": 0, "tree_mask": 0},
                         stack.InPlace(lambda L: {}), head=None)
    assert seen[1:] == [(cfg, L, plan.moe_inter) for L in range(cfg.num_hidden_layers)]
    ops = MeterOps(RankLayout.from_plan(plan.to_dict(), 0), specs, {"q": 9, "T": 64, "S": 80, "W": 1})
    assert not any(r.op.endswith("_requests") for r in meter_call(ops, "moe_layer", layers.decoder_layer, cfg, 1,
                                                                   plan.moe_inter))


def test_a_backend_without_request_ops_refuses_them_by_name():
    ops = object.__new__(OnnxOps)
    with pytest.raises(NotImplementedError, match="OnnxOps has no mla_tree_attention_requests"):
        ops.mla_tree_attention_requests(None, None, (), None, None, None, None)
    with pytest.raises(NotImplementedError, match="OnnxOps has no kv_append_requests"):
        ops.kv_append_requests((), None, None, None, None)


def test_the_cuda_request_spans_on_the_host():
    """CPU part of the cuda backend's request ops: request i's length is a [1] view 4 i bytes into cache_len with its
    host copy; row offsets known only on the device (no host copy) are refused, as is a mask of the wrong shape."""
    from ddtree.backends.cuda_backend import CudaOps
    from ddtree.backends.cuda_tensor import Tensor
    ops = object.__new__(CudaOps)
    ops.where = "test"
    lens = np.array([9, 0, 33], np.int32)
    cache_len = Tensor(4096, (3,), np.dtype(np.int32), (1,), host=lens)
    off = np.array([0, 5, 45, 47], np.int32)
    row_offsets = Tensor(8192, (4,), np.dtype(np.int32), (1,), host=off)
    masks = [Tensor(0, (n, -(-n // 32)), np.dtype(np.int32), (-(-n // 32), 1)) for n in (5, 40, 2)]
    spans = ops.request_spans([None] * 3, cache_len, row_offsets, 47, masks)
    assert [(s.ptr, s.shape, s.host.tolist(), a, b) for s, a, b in spans] == \
        [(4096, (1,), [9], 0, 5), (4100, (1,), [0], 5, 45), (4104, (1,), [33], 45, 47)]
    with pytest.raises(ValueError, match="host-fed"):
        ops.request_spans([None] * 3, cache_len, Tensor(8192, (4,), np.dtype(np.int32), (1,)), 47)
    with pytest.raises(ValueError, match=r"tree_mask.1 must be \[40, 2\]"):
        ops.request_spans([None] * 3, cache_len, row_offsets, 47, [masks[0], masks[0], masks[2]])
