"""--prune auto on the CPU (issue 53): DDTree with trees pruned inside the verify commits exactly AR's tokens on the
tiny model's engine (numpy executor over the op set), greedy and sampled (T 0.8), budgets 4 and 16, at the default
rate, at a moderate rate that prunes some nodes at budget 16 (MID: a node charged for its marginal experts over the
3 MoE layers left; charged for one layer, the sampled run prunes none) and at a rate so high that most nodes go
(pruned_nodes > 0 proves the pruned path ran), tp 1 and tp 2 ranks as threads; the stats are the run's; each prune
layer's tree_prune gets the MoE layers left as its horizon and its mask is prune_nodes' with it; executors that cannot
prune refuse by name; the description's default path is today's, op for op (no tree_prune, no keyword to the MoE,
decoder layers called with today's arguments); dead rows route to no expert and the live rows' MoE output is the
unpruned one."""
import numpy as np
import pytest

from ddtree.builder.build import build_engine
from ddtree.data import tiny_model_dirs
from ddtree.description import layers, stack
from ddtree.runtime.cuda_executor import CudaExecutor
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.runtime.executor import NumpyExecutor
from ddtree.runtime.graph_executor import GraphExecutor
from ddtree.runtime.loop import RunStats, ar_steps, ddtree_steps, run_to_end
from ddtree.runtime.pruning import Pruner, PruneRefused
from ddtree.tree.prune import PRUNE_EVERY, prune_nodes
from ddtree.tree.sampling import SamplingParams

PROMPT = [256] + list(b"def fibonacci(n):\n    if n < 2:\n        return n\n")
N = 40
HIGH = 1e-4          # tokens per byte: with the tiny model's ~110 KB experts, any node with a marginal expert goes
MID = 1e-7           # a node with one marginal expert goes below path prob 1e-7 x 110592 x 3 layers ~ 0.033


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("prune")
    return {tp: build_engine(*tiny_model_dirs(), tp, [], root / f"tp{tp}", graphs=False, kernels=False)["engine"]
            for tp in (1, 2)}


@pytest.fixture(scope="module")
def ex(engines):
    return EngineExecutor(engines[1])


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=5)], ids=["greedy", "t0.8"])
@pytest.mark.parametrize("budget", [4, 16])
@pytest.mark.parametrize("rate,every", [(None, PRUNE_EVERY), (MID, PRUNE_EVERY), (HIGH, 1), (HIGH, PRUNE_EVERY)],
                         ids=["default", "moderate", "high-every-layer", "high-every-4"])
def test_pruned_ddtree_equals_ar(ex, params, budget, rate, every):
    want = run_to_end(ar_steps(ex, PROMPT, N, params))
    stats = RunStats()
    got = run_to_end(ddtree_steps(ex, PROMPT, N, params, budget, stats=stats, prune=Pruner.for_executor(ex, rate=rate,
                                                                                                       every=every)))
    assert got == want
    d = stats.to_dict()
    assert len(d["pruned_per_step"]) == stats.steps and d["pruned_nodes"] == sum(d["pruned_per_step"])
    assert all(0 <= p <= budget for p in d["pruned_per_step"])
    assert d["prune_rate_source"] == ("given" if rate else "default (tree/prune.py DEFAULT_RATE_PER_TOKEN: no tuning.json)")
    assert d["expected_saving_expert_layers"] >= 0 and (d["pruned_nodes"] or not d["expected_saving_expert_layers"])
    if rate == HIGH:
        assert d["pruned_nodes"] > 0 and d["distinct_experts_after"] < d["distinct_experts_before"]
    elif rate == MID and budget == 16:            # (a dropped node's later experts may be shared: no fewer read)
        assert d["pruned_nodes"] > 0 and d["distinct_experts_after"] <= d["distinct_experts_before"]
    else:
        assert d["distinct_experts_after"] <= d["distinct_experts_before"]


def test_pruned_ranks_as_threads_agree(engines):
    ex2 = EngineExecutor(engines[2])
    params = SamplingParams(temperature=0.8, seed=9)
    stats = RunStats()
    got = run_to_end(ddtree_steps(ex2, PROMPT, 24, params, 16, stats=stats, prune=Pruner.for_executor(ex2, rate=HIGH,
                                                                                                     every=1)))
    assert got == run_to_end(ar_steps(ex2, PROMPT, 24, params)) and stats.prune.to_dict()["pruned_nodes"] > 0


def test_executors_that_cannot_prune_refuse_by_name(ex):
    assert ex.prune_forward is not None and not ex.prunes_in_step
    assert CudaExecutor.prunes_in_step and callable(CudaExecutor.prune_forward)     # tp 1 prunes in its step graph
    for cls, name, why in [(GraphExecutor, "engine-graphs", "ONNX"), (GraphExecutor, "tensorrt", "TensorRT"),
                           (CudaExecutor, "cuda", "tp > 1"), (NumpyExecutor, "numpy", "reference")]:
        other = object.__new__(cls)
        other.name = name
        if cls is CudaExecutor:
            other.prune_forward = None          # what _setup leaves at tp > 1 (TpSteps have no pruned verify)
        assert other.prune_forward is None
        with pytest.raises(PruneRefused, match=f"--prune auto.*the {name} executor cannot.*{why}"):
            Pruner.for_executor(other)


class Recorder:
    """An Ops proxy that records each op called (name, keyword names) and runs the numpy rank's."""

    def __init__(self, ops):
        self.ops, self.calls = ops, []

    def __getattr__(self, name):
        fn = getattr(self.ops, name)
        if not callable(fn):
            return fn

        def op(*args, **kw):
            self.calls.append((name, tuple(sorted(kw))))
            return fn(*args, **kw)
        return op


def test_each_prune_layer_charges_the_moe_layers_left(ex):
    cfg, ops = ex.config, ex.ranks.ranks[0]
    assert [layers.moe_horizon(cfg, L) for L in cfg.moe_layers] == list(range(len(cfg.moe_layers) - 1, -1, -1))
    with pytest.raises(ValueError, match="not an MoE layer"):
        layers.moe_horizon(cfg, 0)                               # the tiny model's layer 0 is dense
    q = 17
    seen = []

    class Spy(Recorder):
        def __getattr__(self, name):
            fn = super().__getattr__(name)
            if name != "tree_prune":
                return fn

            def tree_prune(*args):
                live = fn(*args)
                seen.append((args, live))
                return live
            return tree_prune

    rng = np.random.default_rng(4)
    decided_by_horizon = 0
    for j, L in enumerate(cfg.moe_layers):
        live0 = (rng.random(q) < 0.3).astype(np.int32)            # few live leaves of a star: marginal experts
        live0[0] = 1
        ops.feeds = {**layer_feeds(ex, q), "live": live0, "parents": np.array([-1] + [0] * (q - 1), np.int32),
                     "path_prob": rng.uniform(0, 0.1, q).astype(np.float32), "prune_rate": np.array([MID], np.float32),
                     "expert_bytes": np.array([ex.expert_bytes], np.int32)}
        ops.outputs = {}
        layers.decoder_layer(Spy(ops), cfg, L, ex.moe_inter, prune="prune")
        (live, parents, path, ids, rate, bytes_, horizon), out = seen[-1]
        assert horizon == len(cfg.moe_layers) - j - 1 and type(horizon) is int          # an attribute, not a feed
        want = prune_nodes(live, parents, path, ids, ex.expert_bytes, MID, horizon=horizon)
        assert np.asarray(out).tolist() == want.tolist() == np.asarray(ops.outputs["live_out"]).tolist()
        one_more = prune_nodes(live, parents, path, ids, ex.expert_bytes, MID, horizon=horizon + 1)
        decided_by_horizon += want.tolist() != one_more.tolist()
    assert decided_by_horizon > 0                   # the inputs tell a layer's horizon from one more layer


def layer_feeds(ex, q: int) -> dict:
    cfg = ex.config
    rng = np.random.default_rng(0)
    return {"h": rng.normal(size=(q, cfg.hidden_size)), "pos": np.arange(q, dtype=np.int32),
            "cache": np.zeros((64, cfg.kv_lora_rank + cfg.qk_rope_head_dim)), "cache_len": np.array([0], np.int32),
            "tree_mask": np.tril(np.ones((q, q), bool)).dot(1 << np.arange(q)).astype(np.int32)[:, None]}


def names_on(rec) -> list[str]:
    return [n for n, _ in rec.calls]


def test_default_path_is_todays_op_for_op(ex):
    cfg, ops = ex.config, ex.ranks.ranks[0]
    L = cfg.moe_layers[0]
    q = 5
    off = Recorder(ops)
    ops.feeds, ops.outputs = layer_feeds(ex, q), {}
    layers.decoder_layer(off, cfg, L, ex.moe_inter)
    names = [n for n, _ in off.calls]
    assert "tree_prune" not in names and ("moe", ()) in off.calls and set(ops.outputs) == {"h_out", "cache_out"}
    on = Recorder(ops)
    ops.feeds = {**layer_feeds(ex, q), "live": np.ones(q, np.int32), "parents": np.arange(-1, q - 1, dtype=np.int32),
                 "path_prob": np.ones(q, np.float32), "prune_rate": np.zeros(1, np.float32),
                 "expert_bytes": np.array([1], np.int32)}
    ops.outputs = {}
    layers.decoder_layer(on, cfg, L, ex.moe_inter, prune="prune")
    assert "moe" not in names_on(on) and names_on(on).count("moe_live") == 1 and "tree_prune" in names_on(on)
    assert [c for c in on.calls if c[0] not in ("moe_live", "tree_prune", "input", "output")] == \
        [c for c in off.calls if c[0] not in ("moe", "input", "output")]       # the rest of the layer unchanged
    # the stack calls every decoder layer with today's arguments unless it prunes
    seen = []

    def run(kind, fn, args, feeds, layer=None):
        seen.append((kind, args))
        return {"h": 0, "h_out": 0} if fn is not layers.head else {}
    stack.target_forward(run, cfg, ex.moe_inter, {"ids": 0, "pos": 0, "cache_len": 0, "tree_mask": 0},
                         stack.InPlace(lambda L: {}), head=None)
    assert [a for k, a in seen if k in ("moe_layer", "dense_layer")] == \
        [(cfg, L, ex.moe_inter) for L in range(cfg.num_hidden_layers)]


def test_dead_rows_route_to_no_expert(ex):
    cfg, ops = ex.config, ex.ranks.ranks[0]
    m = layers.layer_prefix(cfg.moe_layers[0]) + "mlp."
    ops.feeds, ops.outputs = {}, {}
    x = np.random.default_rng(1).normal(size=(6, cfg.hidden_size))
    live = np.array([1, 0, 1, 1, 0, 0], np.int32)
    full = layers.moe(ops, cfg, m, x, ex.moe_inter)
    pruned, ids = layers.moe(ops, cfg, m, x, ex.moe_inter, live=live)
    shared = ops.swiglu_mlp(x, *(ops.weight(n) for n in layers.mlp_names(m + "shared_experts.")))
    np.testing.assert_allclose(pruned[live == 1], full[live == 1], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(pruned[live == 0], shared[live == 0], rtol=1e-12, atol=1e-14)
    assert not np.allclose(full[live == 0], shared[live == 0])          # the routed part was there before
    assert ids.shape == (6, cfg.num_experts_per_tok) and ids.dtype == np.int32


def test_the_accept_layer_treats_dead_nodes_as_absent(ex):
    ops = ex.ranks.ranks[0]
    feeds = {"tokens": np.array([7, 3, 4, 5], np.int32), "parents": np.array([-1, 0, 0, 1], np.int32),
             "win_value": np.zeros(4), "win_id": np.array([3, 5, 9, 9], np.int32)}
    full = ops.call(layers.accept, feeds=feeds)
    assert full["accepted"].tolist() == [0, 1, 3, -1] and int(full["bonus"][0]) == 9
    pruned = ops.call(layers.accept, True, feeds={**feeds, "live": np.array([1, 1, 1, 0], np.int32)})
    assert pruned["accepted"].tolist() == [0, 1, -1, -1] and int(pruned["bonus"][0]) == 5
    assert pruned["target_tokens"].tolist() == full["target_tokens"].tolist()
