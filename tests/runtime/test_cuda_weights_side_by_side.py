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


def test_every_layer_holds_kv_a_and_q_a_and_every_drafter_layer_q_k_v_side_by_side():
    for preset, tp, layers in (("kimi-k2.6", 8, 3), ("tiny", 1, None)):
        cfg, shapes = _shapes(preset, tp, layers)
        groups = side_by_side(shapes)
        want = [(f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", f"model.layers.{i}.self_attn.q_a_proj.weight")
                for i in range(cfg.num_hidden_layers)]
        drafter = sorted({n.split(".")[2] for n in shapes if n.startswith("drafter.layers.")}, key=int)
        want += [tuple(f"drafter.layers.{i}.self_attn.{p}_proj.weight" for p in "qkv") for i in drafter]
        assert len(drafter) > 0 and sorted(groups) == sorted(want), preset


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


def test_a_run_of_consecutive_members_is_a_group_of_its_own():
    """CudaWeights._group: (q, k, v) stored once; (k, v) (the drafter's context GEMM) and (q, k) are views of the
    same buffer starting at their first member's tiles, (q, v) (not consecutive) is no group."""
    from ddtree.runtime.cuda_weights import CudaWeights

    class Buf:
        def __init__(self, offset, shape):
            self.offset, self.shape = offset, tuple(shape)

        def view(self, offset, shape):
            return Buf(self.offset + offset, shape)

    store = CudaWeights.__new__(CudaWeights)
    store._tiled, store._groups = {}, {}
    shapes = [(64, 2, 4, 32, 8), (8, 2, 4, 32, 8), (8, 2, 4, 32, 8)]          # tile rows 64 / 8 / 8 of K 128
    store._group(("q", "k", "v"), Buf(0, (80 * 2 * 4 * 32 * 8,)), shapes)
    per_tile_row = 2 * 4 * 32 * 8
    assert store.tiled_group(("k", "v")).offset == 64 * per_tile_row == store._tiled["k"].offset
    assert store.tiled_group(("k", "v")).shape == (16, 2, 4, 32, 8)
    assert store.tiled_group(("q", "k")).offset == 0 and store.tiled_group(("q", "k")).shape[0] == 72
    assert store.tiled_group(("q", "k", "v")).shape[0] == 80 and store.tiled_group(("q", "v")) is None
