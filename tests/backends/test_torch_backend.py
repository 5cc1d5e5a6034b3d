"""The torch backend (ddtree/backends/torch_backend.py) runs description/layers.py as the numpy backend does.

On the embedded tiny model, two sequences in one batch against the numpy backend (float64, one sequence at a
time, EngineExecutor over the tp 1 rank tensors): a prefill and a tree verify through the target stack (logits,
every layer's output, the latent caches), two drafter calls with a growing context (full and sliding-window
attention), and the sampling / tree / walk / compaction ops. Float32 against float64 agrees to ~1e-6 of the
outputs' scale (measured 6e-7 on the logits); the bound TOL is 2e-5, and a rope that pairs (i, i + d/2) instead
of (2i, 2i + 1) misses it by far (checked). Training's use of it: generate.py's greedy tokens equal the float64
executor's; gradients through the description equal finite differences (float64) and reach every weight that
should get one.
"""
import inspect
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ddtree.backends import torch_backend as tb  # noqa: E402
from ddtree.backends.numpy_backend import NumpyOps  # noqa: E402
from ddtree.builder.plan import make_plan  # noqa: E402
from ddtree.builder.weights import write_rank_weights  # noqa: E402
from ddtree.data import tiny_model_dirs  # noqa: E402
from ddtree.description import layers  # noqa: E402
from ddtree.description.opset import OP_NAMES, Ops, RankLayout  # noqa: E402
from ddtree.engine_dir import load_rank_tensors  # noqa: E402
from ddtree.model.checkpoint import Checkpoint, DrafterCheckpoint  # noqa: E402
from ddtree.model.routing import route_logits  # noqa: E402
from ddtree.reference.model import Target, causal_visible  # noqa: E402
from ddtree.runtime.engine_executor import EngineExecutor  # noqa: E402
from ddtree.runtime.executor import NumpyExecutor  # noqa: E402
from ddtree.runtime.loop import ar_steps, run_to_end  # noqa: E402
from ddtree.training.export import load_drafter, load_target  # noqa: E402
from ddtree.training.generate import greedy_continue  # noqa: E402
from ddtree.tree.build import Tree, pack_visibility  # noqa: E402
from ddtree.tree.sampling import SamplingParams  # noqa: E402

TOL = 2e-5                                     # of the reference output's largest magnitude
PROMPTS = [b"    def get(self, block=True, t", b"import os\nfrom pathlib import P"]
TREE_PARENTS = [-1, 0, 0, 1, 2, 3]
TREE_IDS = [[58, 10, 32, 32, 40, 41], [97, 116, 104, 10, 105, 109]]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(numpy EngineExecutor over the tp 1 rank tensors, TorchOps over the training modules' parameters, plan)."""
    target_dir, drafter_dir = tiny_model_dirs()
    ckpt, dckpt = Checkpoint(target_dir), DrafterCheckpoint(drafter_dir)
    plan = make_plan(ckpt.config, dckpt.config, 1).to_dict()
    out = tmp_path_factory.mktemp("tiny-tp1")
    files = write_rank_weights(make_plan(ckpt.config, dckpt.config, 1), ckpt, dckpt, out)
    rank = load_rank_tensors(out, 0, files, convert=np.dtype(np.float64))
    target, drafter = load_target(target_dir), load_drafter(drafter_dir)
    weights = {**dict(target.named_parameters()), **dict(target.named_buffers()),
               **{f"drafter.{n}": p for n, p in drafter.named_parameters()}}
    ops = tb.TorchOps(weights, tb.tp1_layout(ckpt.config, dckpt.config))
    return EngineExecutor.of_weights(ckpt.config, dckpt.config, plan, [rank]), ops, plan, rank


def test_every_op_is_implemented_with_the_op_sets_signature():
    assert not tb.TorchOps.__abstractmethods__
    for name in OP_NAMES:
        assert getattr(tb.TorchOps, name) is not getattr(Ops, name), f"TorchOps.{name} is not implemented"
        want = list(inspect.signature(getattr(Ops, name)).parameters)
        assert list(inspect.signature(getattr(tb.TorchOps, name)).parameters) == want, f"TorchOps.{name}"
    with pytest.raises(ValueError, match="tp 1"):
        tb.TorchOps({}, RankLayout(1, 2, 0, 8, 0, 8, 0, 8))


def test_bad_feeds_and_missing_weights_name_what_was_expected(tiny):
    ex, ops, _, _ = tiny
    cfg, H = ex.config, ex.config.hidden_size
    want = rf"head_logits\(\) \(torch\): input 'h' must be \['B', 'q', {H}\], got \[3, {H}\]"
    with pytest.raises(ValueError, match=want):
        ops.call(layers.head_logits, cfg, feeds={"h": torch.zeros(3, H)})
    with pytest.raises(KeyError, match="input 'ids'"):
        ops.call(layers.embed, cfg, feeds={})
    with pytest.raises(KeyError, match=r"'model.layers.9.mlp.experts.0.gate_proj.weight' is not among the weights"):
        ops.weight("model.layers.9.mlp.experts.down.scales")


def assert_close(got, want, what: str, tol: float = TOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    err, scale = np.abs(got - want).max(), np.abs(want).max()
    assert scale > 0.1 and err <= tol * scale, f"{what}: max error {err:.3g} for outputs up to {scale:.3g}"


def target_calls(P: int):
    """(ids [2, q], pos [q], visible [q, T + q], T) of a prefill, then of a tree verify after it."""
    tree = Tree.from_parents(TREE_PARENTS)
    ids = np.stack([np.frombuffer(p, np.uint8) for p in PROMPTS]).astype(np.int32)
    verify_vis = np.concatenate([np.ones((tree.size, P), bool), tree.visible()], axis=1)
    return [(ids, np.arange(P), causal_visible(0, P), 0),
            (np.array(TREE_IDS, np.int32), tree.positions(P), verify_vis, P)]


def torch_target_calls(ops, cfg, P: int, caches):
    out = []
    with torch.no_grad():
        for ids, pos, vis, T in target_calls(P):
            words = torch.from_numpy(pack_visibility(vis[:, T:]).view(np.int32))
            out.append(tb.target_forward(ops, cfg, torch.from_numpy(ids), torch.from_numpy(pos).int(), caches,
                                         torch.tensor([T], dtype=torch.int32), words,
                                         taps=range(cfg.num_hidden_layers)))
    return out


def test_target_stack_equals_the_numpy_backend(tiny, monkeypatch):
    ex, ops, _, _ = tiny
    cfg, P = ex.config, len(PROMPTS[0])
    caches = tb.new_target_caches(cfg, 2, 48)
    got = torch_target_calls(ops, cfg, P, caches)
    all_layers = range(cfg.num_hidden_layers)
    for s in range(2):
        cache = ex.new_target_cache(48)
        for c, (ids, pos, vis, T) in enumerate(target_calls(P)):
            logits, taps = ex.target_forward(ids[s], pos, vis, cache, taps=all_layers)
            assert_close(got[c][0][s], logits, f"sequence {s} call {c}: logits")
            for L in all_layers:
                assert_close(got[c][1][L][s], taps[L], f"sequence {s} call {c}: layer {L}'s output")
        for L in all_layers:                                 # the latent rows (c_kv normed | k_pe roped)
            assert_close(caches[L][s, : cache.length], cache.layers[0][L][: cache.length], f"layer {L}'s cache")
    assert (caches[0][:, cache.length:] == 0).all()                              # nothing beyond the rows written

    # the bound is tight enough: interleaved pairs read as halves (a wrong rope pairing) miss it by far
    def halves(self, x, pos, rope):
        return tb.rotate_half(x, *tb.rope_table(pos, rope, x.shape[-1], 1.0, torch.float32))
    monkeypatch.setattr(tb.TorchOps, "rope", halves)
    wrong = torch_target_calls(ops, cfg, P, tb.new_target_caches(cfg, 2, 48))
    cache = ex.new_target_cache(48)
    want = [ex.target_forward(ids[0], pos, vis, cache)[0] for ids, pos, vis, _ in target_calls(P)]
    assert np.abs(wrong[1][0][0].numpy() - want[1]).max() > 100 * TOL * np.abs(want[1]).max()


@pytest.mark.parametrize("window", [0, 5])
def test_drafter_stack_equals_the_numpy_backend(tiny, window):
    """Two drafting calls with a growing context (cache_len 0, then 9), full attention or a sliding window."""
    ex, ops, plan, rank = tiny
    cfg, dcfg = ex.config, replace(ex.drafter_config, sliding_window=window or None)
    ex = EngineExecutor.of_weights(cfg, dcfg, plan, [rank])
    rng = np.random.default_rng(3)
    b, width = dcfg.block_size, dcfg.num_taps * dcfg.hidden_size
    ctx = [rng.normal(0, 3, (2, n, width)) for n in (9, 4)]                       # [B, n, K H] per call
    blocks = [rng.integers(0, 256, (2, b)).astype(np.int32) for _ in ctx]
    starts = [9, 13]                                                             # the block after the context
    kv = dcfg.num_key_value_heads
    caches_k = [torch.zeros(2, 16, kv, dcfg.head_dim) for _ in range(dcfg.num_hidden_layers)]
    caches_v = [torch.zeros(2, 16, kv, dcfg.head_dim) for _ in range(dcfg.num_hidden_layers)]
    got = []
    with torch.no_grad():
        for c, (x, blk, a) in enumerate(zip(ctx, blocks, starts)):
            got.append(tb.drafter_forward(ops, cfg, dcfg, torch.from_numpy(blk), torch.arange(a, a + b).int(),
                                          torch.from_numpy(x).float(), caches_k, caches_v,
                                          torch.tensor([9 * c], dtype=torch.int32)))
    for s in range(2):
        cache = ex.new_drafter_cache(16)
        for c, (x, blk, a) in enumerate(zip(ctx, blocks, starts)):
            want = ex.drafter_forward(blk[s], np.arange(a, a + b), x[s], cache)
            assert_close(got[c][s], want, f"window {window}, sequence {s}, call {c}: draft logits")
        for L in range(dcfg.num_hidden_layers):
            assert_close(caches_k[L][s, :13], cache.k[0][L][:13], f"drafter layer {L}'s context keys")
            assert_close(caches_v[L][s, :13], cache.v[0][L][:13], f"drafter layer {L}'s context values")


def test_sampling_tree_walk_and_compaction_ops_equal_numpy(tiny):
    """The same inputs through both backends' head, draft_head, tree, accept and compact: equal outputs."""
    ex, ops, plan, rank = tiny
    cfg, dcfg = ex.config, ex.drafter_config
    np_ops = NumpyOps(rank, RankLayout.from_plan(plan, 0))
    rng = np.random.default_rng(5)
    h = rng.normal(0, 1, (2, 6, cfg.hidden_size))
    for temperature in (0.0, 0.8):
        step = {"sample_pos": np.arange(10, 16, dtype=np.int32), "temperature": np.array([temperature], np.float32),
                "seed": np.array([7, 0], np.int32)}
        got = ops.call(layers.head, cfg, feeds={**{k: torch.from_numpy(v) for k, v in step.items()},
                                                "h": torch.from_numpy(h).float()})
        for s in range(2):
            want = np_ops.call(layers.head, cfg, feeds={**step, "h": h[s]})
            np.testing.assert_array_equal(got["win_id"][s].numpy(), want["win_id"])
    k, budget = 8, 12
    hd = rng.normal(0, 1, (2, dcfg.block_size, dcfg.hidden_size))
    got = ops.call(layers.draft_head, dcfg, k, feeds={"h": torch.from_numpy(hd).float()})
    for s in range(2):
        want = np_ops.call(layers.draft_head, dcfg, k, feeds={"h": hd[s]})
        np.testing.assert_array_equal(got["topk_ids"][s].numpy(), want["topk_ids"])
        cand = {n: want[n] for n in ("topk_values", "topk_ids", "row_max", "row_sumexp")}
        batched = {n: torch.from_numpy(v)[None] for n, v in cand.items()}                 # one sequence: [1, ...]
        tree_t = ops.call(layers.tree, dcfg, k, budget, feeds={"root": torch.tensor([[65]]), **batched})
        tree_n = np_ops.call(layers.tree, dcfg, k, budget, feeds={"root": np.array([65]), **cand})
        for name in ("tokens", "parents", "depth", "visibility"):
            np.testing.assert_array_equal(tree_t[name][0].numpy(), tree_n[name])
        n = budget + 1
        win = {"win_value": rng.normal(0, 1, n), "win_id": tree_n["tokens"][np.r_[1:n, 0]].astype(np.int32)}
        walk_t = ops.call(layers.accept, feeds={"tokens": tree_t["tokens"], "parents": tree_t["parents"],
                                                **{w: torch.from_numpy(v)[None] for w, v in win.items()}})
        walk_n = np_ops.call(layers.accept, feeds={"tokens": tree_n["tokens"], "parents": tree_n["parents"], **win})
        assert walk_n["accepted_count"][0] >= 2                          # the winners follow the tree a while
        for name in ("target_tokens", "accepted", "accepted_count", "bonus"):
            np.testing.assert_array_equal(walk_t[name][0].numpy(), walk_n[name])
    W = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    cache = rng.normal(0, 1, (20, W))
    step = {"cache_len": np.array([6], np.int32), "accepted": np.array([0, 2, 5, -1], np.int32),
            "accepted_count": np.array([3], np.int32)}
    got = ops.call(layers.compact, cfg, feeds={"cache": torch.from_numpy(cache)[None].clone(),
                                               **{k: torch.from_numpy(v) for k, v in step.items()}})
    want = np_ops.call(layers.compact, cfg, feeds={"cache": cache.copy(), **step})
    np.testing.assert_array_equal(got["cache_out"][0].numpy(), want["cache_out"])


def test_group_limited_routing_equals_route_logits():
    """select_experts against model/routing.py on scores with ties (rounded), n_group 4 of 16 experts."""
    rng = np.random.default_rng(2)
    logits = np.round(rng.normal(0, 1, (64, 16)), 1)
    bias = np.round(rng.normal(0, 0.1, 16), 2)
    for n_group, topk_group in ((1, 1), (4, 2)):
        want, _, _ = route_logits(logits, bias, 4, n_group, topk_group)
        choice = torch.sigmoid(torch.from_numpy(logits)) + torch.from_numpy(bias)
        np.testing.assert_array_equal(tb.select_experts(choice, 4, n_group, topk_group).numpy(), want)


def test_greedy_continuation_equals_the_float64_executor():
    target_dir, _ = tiny_model_dirs()
    model = load_target(target_dir).eval()
    ex = NumpyExecutor(Target.from_checkpoint(target_dir))
    prompts = [p[:28] for p in (b"class Queue:\n    def put(self,", b"    for i in range(len(items)):",
                                b"def main(argv=None):\n    p = ")]
    P, n = 28, 20
    ids = torch.tensor([list(p) for p in prompts])
    got = greedy_continue(model, ids, n)
    for s, p in enumerate(prompts):
        want = run_to_end(ar_steps(ex, list(p), n, SamplingParams()))
        assert got[s, P:].tolist() == want, f"prompt {s}"
    assert len({t for row in got[:, P:].tolist() for t in row}) >= 8         # real continuations, not one byte


def loss_of(model, ids):
    logits, _ = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def test_gradients_through_the_description_equal_finite_differences():
    """float64: the directional derivative along a random direction over every parameter, both ways."""
    model = load_target(tiny_model_dirs()[0]).double().train()
    ids = torch.tensor([list(b"def f(x):\n    return x"), list(b"import numpy as np\nfro")])
    loss = loss_of(model, ids)
    model.zero_grad()
    loss.backward()
    gen = torch.Generator().manual_seed(0)
    params = [p for p in model.parameters()]
    direction = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
    analytic = sum(float((p.grad * v).sum()) for p, v in zip(params, direction) if p.grad is not None)
    eps = 1e-6
    with torch.no_grad():
        for p, v in zip(params, direction):
            p += eps * v
        up = float(loss_of(model, ids))
        for p, v in zip(params, direction):
            p -= 2 * eps * v
        down = float(loss_of(model, ids))
    numeric = (up - down) / (2 * eps)
    assert abs(analytic) > 1e-3 and abs(numeric - analytic) <= 1e-6 * abs(analytic), (numeric, analytic)


def test_training_forward_grads_loads_quant_and_dropout():
    """float32 training mode with QAT and dropout on: finite non-zero gradients on every weight the tokens reach
    (each routed expert exactly when it was routed to), none on the correction bias; loads count every choice."""
    torch.manual_seed(0)
    model = load_target(tiny_model_dirs()[0]).train()
    cfg = model.cfg
    model.set_expert_quant(cfg.quant.group_size)
    model.dropout = 0.1
    ids = torch.tensor([list(b"    def get(self, block=True, timeout=None):")])
    loss_of(model, ids).backward()
    loads = {L: layer.mlp.load for L, layer in enumerate(model.model.layers) if cfg.is_moe_layer(L)}
    for name, p in model.named_parameters():
        expert = name.split(".mlp.experts.")
        if len(expert) == 2:
            L, e = int(name.split(".")[2]), int(expert[1].split(".")[0])
            assert (p.grad is not None) == bool(loads[L][e] > 0), name
            if p.grad is None:
                continue
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name
    for L, load in loads.items():
        assert load.sum() == (ids.shape[1] - 1) * cfg.num_experts_per_tok and (load > 0).sum() >= 2
        assert model.model.layers[L].mlp.gate.e_score_correction_bias.grad is None
    with torch.no_grad():                                 # dropout acts while training only
        train_a, train_b = model(ids)[0], model(ids)[0]
        model.eval()
        eval_a, eval_b = model(ids)[0], model(ids)[0]
    assert not torch.equal(train_a, train_b) and torch.equal(eval_a, eval_b)
