"""The projection model (issue 21) against hand arithmetic, its fits against their cited rows, and the
meter's bytes for one Kimi K2.6 MoE layer against a count from the tensor shapes of docs/kimi-k2.md."""
import math

import pytest

from ddtree.backends.meter import MeterOps, Record, meter_call, meter_step
from ddtree.bench.projection import (
    H200,
    HAND_SPLIT,
    NCCL,
    ONE_SHOT,
    AllReduceModel,
    Device,
    KernelClass,
    MeasuredRowsError,
    Projection,
    fit_class,
    fit_line,
)
from ddtree.builder.plan import make_plan
from ddtree.builder.weights import rank_tensor_specs
from ddtree.description import layers
from ddtree.description.opset import RankLayout
from ddtree.model.presets import get_preset


def test_two_kernels_and_one_collective_by_hand():
    dev = Device("toy", bandwidth_tbps=2.0, bf16_tflops=500.0, source="test")   # 2e6 B/us, 5e8 FLOP/us
    classes = {"gemm": KernelClass("gemm", fixed_us=5.0, efficiency=0.5, flop_efficiency=1.0, source="t"),
               "attention": KernelClass("attention", fixed_us=20.0, efficiency=1.0, flop_efficiency=0.25, source="t")}
    ar = AllReduceModel("toy", latency_us=8.0, bandwidth_gbps=4.0, source="t")   # 4e3 B/us
    recs = [Record("linear", "dense_layer", read=8_000_000, written=2_000_000, flops=1_000_000_000),
            Record("mla_tree_attention", "moe_layer", read=4_000_000, written=0, flops=5_000_000_000),
            Record("all_reduce", "moe_layer", collective="all_reduce", message_bytes=256_000)]
    out = Projection(dev, classes, (ar,), tp=8).step(recs)
    linear = 5.0 + 10e6 / (0.5 * 2e6) + 1e9 / (1.0 * 5e8)        # 5 + 10 + 2 = 17 us
    attention = 20.0 + 4e6 / 2e6 + 5e9 / (0.25 * 5e8)            # 20 + 2 + 40 = 62 us
    collective = 8.0 + 256e3 * 7 / 8 / 4e3                       # 8 + 56 = 64 us
    assert (linear, attention, collective) == (17.0, 62.0, 64.0)
    assert out["split_us"]["dense"] == pytest.approx(17.0)
    assert out["split_us"]["attention"] == pytest.approx(62.0)
    assert out["split_us"]["allreduce"] == pytest.approx(64.0)
    assert out["step_us"] == pytest.approx(143.0)
    assert out["collectives"] == [{"op": "all_reduce", "message_bytes": 256_000, "count": 1, "collective": "toy",
                                   "us_each": pytest.approx(64.0), "us": pytest.approx(64.0)}]
    assert 4.5 / (out["step_us"] * 1e-6) == pytest.approx(31468.53, rel=1e-6)   # tokens/s at accept 4.5


def test_the_cheaper_all_reduce_model_is_taken_per_message():
    proj = Projection(H200, HAND_SPLIT, (ONE_SHOT, NCCL), tp=8)
    small, large = 8 * 1024, 932 * 1024
    assert proj.collective_us(small) == ONE_SHOT.us(small, 8) < NCCL.us(small, 8)
    assert proj.collective_us(large) == NCCL.us(large, 8) < ONE_SHOT.us(large, 8)


def test_fit_class_recovers_the_parameters_it_was_made_from():
    dev = Device("toy", 4.0, 1000.0, "t")
    truth = KernelClass("gemm", 7.0, 0.8, 0.5, "t")
    rows = [(b, f, truth.us(dev, b, f)) for b, f in [(1e6, 0), (3e7, 2e9), (1e8, 5e9), (4e8, 1e10)]]
    got = fit_class("gemm", rows, dev, 0.5, "t")
    assert got.fixed_us == pytest.approx(7.0, rel=1e-9) and got.efficiency == pytest.approx(0.8, rel=1e-9)
    with pytest.raises(MeasuredRowsError, match="'gemm'.*2 different byte counts"):
        fit_class("gemm", [(1e6, 0, 5.0), (1e6, 0, 6.0)], dev, 1.0, "t")


C = 4.2e6                                                       # the H200 ceiling in B/us the rows were read at
# Rows of ddtree/plugins/kernels/NOTES.md ("NOTES"). "Follow-up" MoE TP8: (M, ideal us, measured us);
# the route kernel's 3.6 us removed
MOE_TP8 = [(1, 5.9, 27.6), (2, 11.7, 31.7), (4, 22.8, 46.7), (8, 43.1, 77.3), (16, 80.6, 132.4), (64, 208.7, 325.6)]
# NOTES "Follow-up" skinny GEMM TP8 at M = 16: (MB, fraction of the ceiling)
GEMM_TP8_M16 = [(294, 0.74), (66, 0.53), (33, 0.42), (5, 0.19), (7, 0.24)]
# NOTES issue 7, H 8: (T, q, us)
MLA_H8 = [(4096, 4, 20.6), (4096, 8, 15.83), (4096, 16, 19.59), (4096, 64, 49.49), (32768, 4, 37.35),
          (32768, 8, 60.98), (32768, 16, 75.22), (32768, 64, 223.34), (131072, 4, 90.79), (131072, 8, 165.18),
          (131072, 16, 259.88), (131072, 64, 772.22)]


def test_hand_split_constants_are_the_fits_of_the_notes_rows():
    moe = fit_class("moe", [(i * C, 2 * M * 8 * 3 * 256 * 7168, us - 3.6) for M, i, us in MOE_TP8], H200, 1.0, "")
    gemm = fit_class("gemm", [(mb * 1e6, 16 * mb * 1e6, mb * 1e6 / (C * f)) for mb, f in GEMM_TP8_M16], H200, 1.0, "")
    mla = fit_class("attention", [((T + q) * 1152 + q * 8 * 1088 * 2, 2 * q * 8 * (T + q) * 1088, us)
                                  for T, q, us in MLA_H8], H200, 0.2, "")
    for fitted in (moe, gemm, mla):
        hand = HAND_SPLIT[fitted.name]
        assert hand.fixed_us == pytest.approx(fitted.fixed_us, rel=0.01), fitted.name
        assert hand.efficiency == pytest.approx(fitted.efficiency, rel=0.01), fitted.name
        assert hand.flop_efficiency == fitted.flop_efficiency


def test_all_reduce_models_are_the_fits_of_their_cited_rows():
    one_shot = [(256, 7.5), (8192, 9.2), (32768, 16.5), (65536, 25.9), (262144, 73.6)]
    nccl = [(256, 24.1), (8192, 24.6), (32768, 24.5), (65536, 24.1), (262144, 28.0), (393216, 75.0),
            (1.5 * 2 ** 20, 123), (6 * 2 ** 20, 294)]
    for model, rows in ((ONE_SHOT, one_shot), (NCCL, nccl)):
        latency, us_per_byte = fit_line([b * 7 / 8 for b, _ in rows], [us for _, us in rows])
        assert model.latency_us == pytest.approx(latency, rel=0.01)
        assert model.bandwidth_gbps == pytest.approx(1 / us_per_byte / 1e3, rel=0.01)


# ---------------------------------------------------------------------------------------------
# the meter, one MoE layer of Kimi K2.6 at tp 8, rank 0, M = 17 verify rows

H, T, M, TP = 7168, 4096, 17, 8


@pytest.fixture(scope="module")
def kimi_tp8():
    cfg, dcfg = get_preset("kimi-k2.6", layers=3)
    plan = make_plan(cfg, dcfg, TP)
    return cfg, dcfg, plan, rank_tensor_specs(plan)


def layer_records(kimi_tp8, **kw):
    cfg, _, plan, specs = kimi_tp8
    ops = MeterOps(RankLayout.from_plan(plan.to_dict(), 0), specs, {"q": M, "T": T, "S": T + M, "W": 1}, **kw)
    return meter_call(ops, "moe_layer", layers.decoder_layer, cfg, 1, plan.moe_inter)


def hand_weight_bytes(distinct: float) -> float:
    """Rank 0's bytes of layer 1 from docs/kimi-k2.md section 3 (bf16 2 B, f32 4 B, I32 4 B), split 8 ways
    where the plan shards: q_b / kv_b by heads, o_proj by its input, shared and routed experts by their
    intermediate; norms, q_a, kv_a and the router replicated."""
    bf16 = 2
    attention = (7168 * bf16 + 1536 * 7168 * bf16 + 1536 * bf16 + 12288 // TP * 1536 * bf16 + 576 * 7168 * bf16
                 + 512 * bf16 + 16384 // TP * 512 * bf16 + 7168 * 8192 // TP * bf16 + 7168 * bf16)
    router = 384 * 7168 * bf16 + 384 * 4
    shared = 3 * 2048 // TP * 7168 * bf16
    gate_or_up = 2048 // TP * 896 * 4 + 2048 // TP * 224 * bf16            # weight_packed I32 + weight_scale
    down = 7168 * 256 // TP * 4 + 7168 * 64 // TP * bf16
    return attention + router + shared + distinct * (2 * gate_or_up + down)


def test_one_moe_layer_weight_and_kv_bytes_equal_the_hand_count(kimi_tp8):
    recs = layer_records(kimi_tp8, routing="given", distinct=100)
    assert sum(r.weight_read for r in recs) == hand_weight_bytes(100)                 # exact
    kv_row = (512 + 64) * 2                                                         # c_kv + k_pe, bf16
    by_op = {r.op: r for r in recs}
    assert by_op["kv_append_normed"].written == M * kv_row
    assert by_op["kv_append_normed"].read == M * kv_row + 512 * 2 + M * 4 + 4       # latent, norm w, pos, length
    q_lat, q_rope, cache_len, mask = M * 8 * 512 * 2, M * 8 * 64 * 2, 4, M * 1 * 4   # 8 heads a rank
    assert by_op["mla_tree_attention"].read == (T + M) * kv_row + q_lat + q_rope + cache_len + mask


def test_uniform_routing_counts_the_expected_experts(kimi_tp8):
    recs = layer_records(kimi_tp8)
    expected = 384 * (1 - (1 - 8 / 384) ** M)
    assert sum(r.weight_read for r in recs) == pytest.approx(hand_weight_bytes(expected), abs=1)


def test_given_counts_are_taken_one_per_moe_layer_in_order(kimi_tp8):
    cfg, dcfg, plan, specs = kimi_tp8
    counts = [37, 91]                                                               # MoE layers 1 and 2
    recs = meter_step(cfg, dcfg, plan.to_dict(), specs, 0, T, 16, routing="given", distinct=counts)
    assert [r.detail["expected_distinct"] for r in recs if r.op == "moe.experts"] == counts
    with pytest.raises(ValueError, match="routing='given'"):
        meter_step(cfg, dcfg, plan.to_dict(), specs, 0, T, 16, distinct=counts)
    ops = MeterOps(RankLayout.from_plan(plan.to_dict(), 0), specs, {"q": M, "T": T, "S": T + M, "W": 1},
                   routing="given", distinct=[3, 4])
    for _ in range(2):
        meter_call(ops, "moe_layer", layers.decoder_layer, cfg, 1, plan.moe_inter)
    with pytest.raises(ValueError, match="MoE call 3 but only 2"):
        meter_call(ops, "moe_layer", layers.decoder_layer, cfg, 1, plan.moe_inter)
    assert math.isclose(hand_weight_bytes(1) - hand_weight_bytes(0), 3 * 2048 * 7168 // TP * 4.5 / 8)   # 4.5 bits
