"""The meter backend against hand counts, at Kimi K2.6 dimensions (tp 8, rank 0; shapes only, no weights)."""
import math

import numpy as np
import pytest

from ddtree.backends.meter import MeterOps, meter_call, meter_step, totals
from ddtree.bench.kernels import moe_touched_bytes, moe_weight_shapes
from ddtree.builder.plan import make_plan
from ddtree.builder.weights import rank_tensor_specs
from ddtree.description import layers
from ddtree.description.opset import RankLayout
from ddtree.model.presets import get_preset

H, E, K = 7168, 384, 8


@pytest.fixture(scope="module")
def kimi_tp8():
    cfg, dcfg = get_preset("kimi-k2.6", layers=3)
    plan = make_plan(cfg, dcfg, 8)
    return cfg, dcfg, plan, rank_tensor_specs(plan)


def moe_layer(kimi_tp8, M: int, context: int = 4096):
    cfg, _, plan, specs = kimi_tp8
    ops = MeterOps(RankLayout.from_plan(plan.to_dict(), 0), specs, {"q": M, "T": context, "S": context + M, "W": 1})
    assert cfg.is_moe_layer(1) and not cfg.is_moe_layer(0)
    return {r.op: r for r in meter_call(ops, "moe_layer", layers.decoder_layer, cfg, 1, plan.moe_inter)}, ops.records


@pytest.mark.parametrize("M", [1, 16])
def test_moe_experts_bytes_equal_the_moe_benchmarks_touched_bytes(kimi_tp8, M):
    recs, _ = moe_layer(kimi_tp8, M)
    experts = recs["moe.experts"]
    per_expert = sum(math.prod(shape) * np.dtype(dt).itemsize for shape, dt in moe_weight_shapes(E, H, 2048 // 8).values()) / E
    distinct = E * (1 - (1 - K / E) ** M)                       # uniform top-8 of 384, M tokens
    if M == 1:
        assert distinct == pytest.approx(8)
    assert experts.read + experts.written == pytest.approx(moe_touched_bytes(distinct, per_expert, M, H), abs=1)
    assert recs["moe.router"].read == E * H * 2 + M * H * 2 + E * 4   # router weight, x, the f32 bias
    shared_I = 2048 // 8                                        # one shared expert, intermediate split 8 ways
    assert recs["moe.shared"].read == 3 * shared_I * H * 2 + M * H * 2


def test_attention_reads_the_cache_prefix_and_the_new_rows(kimi_tp8):
    recs, _ = moe_layer(kimi_tp8, 17, context=32768)
    attn = recs["mla_tree_attention"]
    cache_rows = (32768 + 17) * 576 * 2
    q_bytes = 17 * 8 * (512 + 64) * 2 + 4 + 17 * 1 * 4         # q_lat, q_rope (8 heads a rank), cache_len, mask
    assert attn.read == cache_rows + q_bytes
    assert attn.flops == 2 * 17 * 8 * (32768 + 17) * (576 + 512)


def test_a_layer_reads_each_of_its_weights_once(kimi_tp8):
    _, _, _, specs = kimi_tp8
    _, recs = moe_layer(kimi_tp8, 1)
    layer = {n: s.nbytes for n, s in specs.items() if n.startswith("model.layers.1.")}
    dense = sum(b for n, b in layer.items() if ".mlp.experts." not in n)
    assert sum(r.weight_read for r in recs if r.op != "moe.experts") == dense
    routed = sum(b for n, b in layer.items() if ".mlp.experts." in n)     # all 384 experts' slices
    assert next(r for r in recs if r.op == "moe.experts").weight_read == pytest.approx(routed * K / E, abs=1)


def test_all_reduces_per_step_equal_the_plan(kimi_tp8):
    cfg, dcfg, plan, specs = kimi_tp8
    recs = meter_step(cfg, dcfg, plan.to_dict(), specs, rank=0, context=4096, budget=16)
    t = totals(recs)
    counts = plan.all_reduce_counts()
    assert t["all_reduces"] == counts["target"] + counts["drafter"] == 1 + 2 * 3 + 2 + 2 * dcfg.num_hidden_layers
    target = [r for r in recs if r.collective and r.kind in ("embed", "dense_layer", "moe_layer")]
    assert {r.message_bytes for r in target} == {17 * H * 2}    # [B + 1, H] bf16 in the verify
    gathers = [r for r in recs if r.collective == "all_gather"]
    assert [r.kind for r in gathers] == ["tree"] * 4 + ["accept"] * 2      # candidates, then sampling winners
    assert gathers[0].message_bytes == (dcfg.block_size - 1) * 16 * 4     # [D, k] fp32 values of one rank
    assert t["kernels"] > 0 and t["flops"] > 0


def test_an_ar_step_reads_the_target_once_and_k_experts(kimi_tp8):
    """meter_ar_step: every target weight of the rank once (the embedding: one row), a MoE layer's routed experts
    only the expected k of E (one token), the KV cache prefix of each layer, no drafter weight."""
    from ddtree.backends.meter import meter_ar_step
    cfg, _, plan, specs = kimi_tp8
    recs = meter_ar_step(cfg, plan.to_dict(), specs, rank=0, context=4096)
    target = {n: s.nbytes for n, s in specs.items() if not n.startswith("drafter.")}
    routed = sum(b for n, b in target.items() if ".mlp.experts." in n)
    embed = target.pop("model.embed_tokens.weight")
    want = sum(b for n, b in target.items() if ".mlp.experts." not in n) + routed * K / E + embed // specs[
        "model.embed_tokens.weight"].shape[0]
    assert sum(r.weight_read for r in recs) == pytest.approx(want, abs=2)
    attn = [r for r in recs if r.op == "mla_tree_attention"]
    assert len(attn) == cfg.num_hidden_layers and all(r.read >= 4097 * 576 * 2 for r in attn)
    assert totals(recs)["all_reduces"] == 1 + 2 * cfg.num_hidden_layers    # the embedding, attention and MLP


def test_the_step_compacts_every_layer_in_one_call(kimi_tp8):
    """The metered step compacts as the cuda executor does: one kv_compact over the stacked caches, moving the
    accepted rows of every layer (L x n x 576 bf16 read and written) in one kernel."""
    cfg, dcfg, plan, specs = kimi_tp8
    recs = [r for r in meter_step(cfg, dcfg, plan.to_dict(), specs, rank=0, context=4096, budget=16)
            if r.op == "kv_compact"]
    moved = cfg.num_hidden_layers * dcfg.block_size * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    assert len(recs) == 1 and recs[0].kernels == 1 and recs[0].kind == "compact"
    assert recs[0].written == moved and recs[0].read >= moved
