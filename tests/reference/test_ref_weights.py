"""Loading the reference from a checkpoint: eager and lazy experts agree, bad weights are named."""
import numpy as np
import pytest

from ddtree.model.bf16 import f32_to_bf16
from ddtree.model.checkpoint import Checkpoint
from ddtree.model.int4 import dequantize_packed
from ddtree.reference.model import Target, causal_visible
from ddtree.reference.weights import load_dense_weights

IDS = np.array([256, 1, 2, 3, 200, 100, 50])


def test_lazy_experts_equal_eager(synth_dir, target):
    eager = target("tiny-grouped")
    lazy = Target.from_checkpoint(synth_dir("tiny-grouped"), lazy_experts=True)
    got = lazy.forward(IDS, np.arange(7), causal_visible(0, 7), lazy.new_cache())[0]
    want = eager.forward(IDS, np.arange(7), causal_visible(0, 7), eager.new_cache())[0]
    np.testing.assert_array_equal(got, want)


def test_experts_are_the_dequantised_int4_tensors(synth_dir, target):
    ckpt = Checkpoint(synth_dir("tiny"))
    m = "model.layers.2.mlp.experts.5.down_proj"
    want = dequantize_packed(ckpt.get(f"{m}.weight_packed"), ckpt.get(f"{m}.weight_scale"),
                             ckpt.get(f"{m}.weight_shape"), 32, np.float64)
    np.testing.assert_array_equal(target("tiny").layers[2].mlp.experts[5].down, want)


def test_float32_target_tracks_float64(synth_dir, target):
    t32 = Target.from_checkpoint(synth_dir("tiny"), dtype=np.float32)
    t64 = target("tiny")
    got = t32.forward(IDS, np.arange(7), causal_visible(0, 7), t32.new_cache())[0]
    want = t64.forward(IDS, np.arange(7), causal_visible(0, 7), t64.new_cache())[0]
    assert t32.new_cache().dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_bad_weights_are_named(synth_dir):
    ckpt = Checkpoint(synth_dir("tiny"))
    weights = load_dense_weights(ckpt)
    missing = dict(weights)
    del missing["model.layers.1.self_attn.kv_b_proj.weight"]
    with pytest.raises(KeyError, match="kv_b_proj.weight"):
        Target(ckpt.config, missing)
    wrong = dict(weights, **{"model.layers.2.mlp.experts.3.up_proj.weight": np.zeros((5, 5))})
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.weight.*shape \[5, 5\]"):
        Target(ckpt.config, wrong)
    bits = dict(weights, **{"model.norm.weight": f32_to_bf16(weights["model.norm.weight"])})
    with pytest.raises(TypeError, match="model.norm.weight.*uint16"):
        Target(ckpt.config, bits)
