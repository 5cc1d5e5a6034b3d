"""Weights over the same x stored side by side (runtime/cuda_weights.py side_by_side; issue 48): which groups a
rank's tensors form, and that the tiles of the group buffer are the members' own tiles in order (the tile_bf16
layout of their row concatenation, so one GEMM over it computes every member's columns)."""
import numpy as np

from ddtree.builder.plan import make_plan
from ddtree.builder.weights import rank_tensor_specs
from ddtree.model.presets import get_preset
from ddtree.plugins.layout import tile_bf16, untile_bf16
from ddtree.runtime.cuda_weights import side_by_side


def _shapes(preset: str, tp: int, layers: int | None = None) -> dict:
    cfg, dcfg = get_preset(preset, layers=layers) if layers else get_preset(preset)
    return cfg, {n: tuple(s.shape) for n, s in rank_tensor_specs(make_plan(cfg, dcfg, tp)).items()}


def test_every_layer_holds_kv_a_and_q_a_side_by_side():
    for preset, tp, layers in (("kimi-k2.6", 8, 3), ("tiny", 1, None)):
        cfg, shapes = _shapes(preset, tp, layers)
        groups = side_by_side(shapes)
        want = [(f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", f"model.layers.{i}.self_attn.q_a_proj.weight")
                for i in range(cfg.num_hidden_layers)]
        assert sorted(groups) == sorted(want), preset
        assert not any(n.startswith("drafter.") for g in groups for n in g)


def test_a_padded_leading_weight_or_another_k_is_not_grouped():
    kv, q = "l.kv_a_proj_with_mqa.weight", "l.q_a_proj.weight"
    assert side_by_side({kv: (576, 7168), q: (1536, 7168)}) == [(kv, q)]
    assert side_by_side({kv: (570, 7168), q: (1536, 7168)}) == []          # kv_a's last tile padded
    assert side_by_side({kv: (576, 7168), q: (1530, 7168)}) == [(kv, q)]   # the last member may be padded
    assert side_by_side({kv: (576, 7168), q: (1536, 1024)}) == []          # not the same x
    assert side_by_side({kv: (576, 7168)}) == []


def test_the_group_buffer_is_the_tiled_row_concatenation():
    rng = np.random.default_rng(0)
    kv = rng.integers(0, 1 << 16, (80, 128), dtype=np.uint16)
    q = rng.integers(0, 1 << 16, (40, 128), dtype=np.uint16)              # padded to 48 rows: the last member
    group = np.concatenate([tile_bf16(kv), tile_bf16(q)])
    both = untile_bf16(group, 80 + 48)
    assert (both[:80] == kv).all() and (both[80:120] == q).all() and (both[120:] == 0).all()
