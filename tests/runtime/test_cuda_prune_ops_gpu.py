"""The cuda backend's pruning ops (backends/cuda_moe.py moe_live, backends/cuda_prune.py tree_prune and
accept_walk_live; issue 53) against the numpy backend's, on the tiny model's tp 1 engine and random inputs:
  moe_live      the routed ids are numpy's on every row whose float64 top-k margin is above fp32 rounding (the
                other rows are routing near-ties, tests/runtime/test_cuda_moe_routing_gpu.py), the output is numpy's
                moe_live to bf16 tolerance on those rows, a dead row's output is the shared expert's bit for bit (its
                routed part is 0), a live row's is the unpruned moe's (bit for bit under the batch-invariant plan),
                and the experts the MoE's tile lists read are exactly the live rows' (the experts-touched count);
  tree_prune    tree/prune.py prune_nodes bit for bit (the op on the device's routing), at horizons 1 and 3;
  accept_walk_live  numpy's accept layer with the live mask, exactly (target tokens, accepted, count, bonus).
Run: python3 -m pytest -q tests/runtime/test_cuda_prune_ops_gpu.py"""
import numpy as np
import pytest

from ddtree.description import layers
from ddtree.description.opset import ACT, F32, I32
from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.model.routing import route_logits
from ddtree.plugins import reference
from ddtree.tree.prune import prune_nodes

pytestmark = pytest.mark.gpu
ROUND = 1e-5                 # a top-k margin at fp32 rounding level (as test_cuda_moe_routing_gpu.py)


@pytest.fixture(scope="module", params=["fast", "batch-invariant"])
def pair(request, tmp_path_factory):
    """(numpy rank ops, cuda ops, config, moe_inter, the rank's stored tensors, kernel plan) of the tiny engine."""
    from ddtree.builder.build import build_engine
    from ddtree.data import tiny_model_dirs
    from ddtree.engine_dir import STORED, check_engine, load_rank_tensors
    from ddtree.runtime.cuda_executor import CudaExecutor
    from ddtree.runtime.engine_executor import EngineExecutor
    root = tmp_path_factory.mktemp("prune-ops")
    engine = build_engine(*tiny_model_dirs(), 1, ["sm_90"], root / "engine", graphs=False)["engine"]
    ref, gex = EngineExecutor(engine), CudaExecutor(engine, max_context=256, graphs=False, kernel_plan=request.param)
    meta, _ = check_engine(engine, True)
    host = load_rank_tensors(engine, 0, meta["weight_files"], convert=STORED)
    return ref.ranks.ranks[0], gex.ops, ref.config, ref.moe_inter, host, request.param


def moe_layer(ops, cfg, L: int, inter: int, pruned: bool) -> None:
    H, k, m = cfg.hidden_size, cfg.num_experts_per_tok, layers.layer_prefix(L) + "mlp."
    x = ops.input("x", ["q", H], ACT)
    if pruned:
        out, ids = layers.moe(ops, cfg, m, x, inter, live=ops.input("live", ["q"], I32))
        ops.output("ids", ids, ["q", k], I32)
    else:
        out = layers.moe(ops, cfg, m, x, inter)
        ops.output("shared", ops.swiglu_mlp(x, *(ops.weight(n) for n in layers.mlp_names(m + "shared_experts."))),
                   ["q", H], ACT)
    ops.output("out", out, ["q", H], ACT)


def prune_layer(ops, horizon: int) -> None:
    live = ops.tree_prune(ops.input("live", ["q"], I32), ops.input("parents", ["q"], I32),
                          ops.input("path_prob", ["q"], F32), ops.input("routed_ids", ["q", "k"], I32),
                          ops.input("prune_rate", [1], F32), ops.input("expert_bytes", [1], I32), horizon)
    ops.output("live_out", live, ["q"], I32)


def bf16_close(y, y_ref) -> tuple[float, float]:
    rms = np.sqrt(np.mean(y_ref ** 2))
    return (np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref),
            (np.abs(y - y_ref) - (4e-3 * np.abs(y_ref) + 2e-2 * rms)).max())


@pytest.mark.parametrize("q", [1, 17, 65])
def test_moe_live_is_numpy_moe_live(pair, q):
    ref_ops, ops, cfg, inter, host, plan = pair
    rng = np.random.default_rng(q)
    for L in cfg.moe_layers:
        m = layers.layer_prefix(L) + "mlp."
        bits = f32_to_bf16(rng.standard_normal((q, cfg.hidden_size)).astype(np.float32))
        x = bf16_to_f32(bits).astype(np.float64)
        live = (rng.random(q) < 0.5).astype(np.int32)
        live[0] = 1
        full = {k: ops.host(v).copy() for k, v in ops.call(moe_layer, cfg, L, inter, False,
                                                           feeds={"x": bits}).items()}
        got = {k: ops.host(v).copy() for k, v in ops.call(moe_layer, cfg, L, inter, True,
                                                          feeds={"x": bits, "live": live}).items()}
        fused = ops.kernels[("moe", m + layers.ROUTER)]
        read = set(fused.tile_expert.numpy()[: int(fused.num_tiles.numpy()[0])].tolist())
        want = ref_ops.call(moe_layer, cfg, L, inter, True, feeds={"x": x, "live": live})
        _, _, margin = route_logits(reference.gemm(bits, host[m + layers.ROUTER]),
                                    host[m + "gate.e_score_correction_bias"], cfg.num_experts_per_tok,
                                    cfg.n_group, cfg.topk_group)
        decided = margin > ROUND
        ids = got["ids"]
        assert ids.shape == (q, cfg.num_experts_per_tok) and ids.dtype == np.int32
        wrong = decided & (np.sort(ids, 1) != np.sort(want["ids"], 1)).any(axis=1)
        assert not wrong.any(), f"layer {L}: rows {np.flatnonzero(wrong)} route {ids[wrong]} vs {want['ids'][wrong]}"
        assert read == set(ids[live == 1].reshape(-1).tolist()), f"layer {L}: the MoE read {read}"
        dead = live == 0
        assert np.array_equal(got["out"][dead], full["shared"][dead])            # the routed part is 0
        y, y_full = bf16_to_f32(got["out"]).astype(np.float64), bf16_to_f32(full["out"]).astype(np.float64)
        if plan == "batch-invariant":
            assert np.array_equal(got["out"][~dead], full["out"][~dead])
        rel, excess = bf16_close(y[~dead], y_full[~dead])
        assert rel <= 1e-2 and excess <= 0, f"layer {L}: live rows vs the unpruned moe, rel {rel:.2e}"
        rel, excess = bf16_close(y[decided], np.asarray(want["out"], np.float64)[decided])
        assert rel <= 1e-2 and excess <= 0, f"layer {L}: vs numpy moe_live, rel {rel:.2e}"


def test_tree_prune_op_is_prune_nodes(pair):
    _, ops, cfg, _, _, _ = pair
    rng = np.random.default_rng(7)
    for q in (1, 9, 65, 256):
        parents = np.array([-1] + [int(rng.integers(i)) for i in range(1, q)], np.int32)
        ids = rng.integers(0, cfg.n_routed_experts, (q, cfg.num_experts_per_tok)).astype(np.int32)
        live = (rng.random(q) < 0.8).astype(np.int32)
        path = rng.uniform(0, 1, q).astype(np.float32)
        for rate in (0.0, 1e-7, 3e-6, 1e-5, 1.0):
            feeds = {"live": live, "parents": parents, "path_prob": path, "routed_ids": ids,
                     "prune_rate": np.array([rate], np.float32), "expert_bytes": np.array([110_000], np.int32)}
            for horizon in (1, 3):
                got = ops.host(ops.call(prune_layer, horizon, feeds=feeds)["live_out"])
                want = prune_nodes(live, parents, path, ids, 110_000, float(np.float32(rate)), horizon=horizon)
                assert got.tolist() == want.tolist(), (q, rate, horizon)


def test_accept_walk_live_is_numpy_accept(pair):
    ref_ops, ops, _, _, _, _ = pair
    rng = np.random.default_rng(8)
    for n in (1, 5, 17, 65, 256):
        parents = np.array([-1] + [int(rng.integers(max(i - 3, 0), i)) for i in range(1, n)], np.int32)
        tokens = rng.integers(0, 4, n).astype(np.int32)                 # few tokens: long accepted paths
        win_value = rng.standard_normal(n).astype(np.float32)
        win_id = rng.integers(0, 4, n).astype(np.int32)
        for p_live in (1.0, 0.6, 0.0):
            live = (rng.random(n) < p_live).astype(np.int32)
            live[0] = 1
            feeds = {"tokens": tokens, "parents": parents, "win_value": win_value, "win_id": win_id, "live": live}
            got = {k: ops.host(v).tolist() for k, v in ops.call(layers.accept, True, feeds=feeds).items()}
            want = {k: np.asarray(v).tolist() for k, v in ref_ops.call(layers.accept, True, feeds=feeds).items()}
            assert got == want, (n, p_live)
            assert all(live[i] for i in got["accepted"] if i >= 0)          # the walk never entered a dead node
