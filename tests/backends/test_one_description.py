"""The per-rank model is written once: a change to the one decoder-layer function reaches every backend.

A known bias is added after o_proj (on rank 0, so the all-reduced sum carries it once) by patching
ops.layers.mla_attention alone. The numpy backend's logits (EngineExecutor) and the ONNX graphs'
logits under onnx.reference (exported in memory from the patched function) must both move by exactly
what the float64 oracle moves by when the same bias is added after its attention output."""
import numpy as np
import pytest

from ddtree.description import layers
from ddtree.model.tensors import TensorSpec
from ddtree.reference.mla import MLA
from ddtree.reference.model import causal_visible
from ddtree.runtime import graph_ranks as onnx_runner
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.runtime.graph_ranks import GraphRanks, mask_words

PROMPT = np.array([256] + list(b"def fib(n):"))
BIAS_NAME = "model.layers.{}.self_attn.o_proj.test_bias"


def biases(cfg) -> dict[int, np.ndarray]:
    """One bias [H] per layer, exact in float32 (multiples of 1/8 in [-1, 1))."""
    rng = np.random.default_rng(11)
    return {L: (rng.integers(-8, 8, cfg.hidden_size) / 8).astype(np.float32) for L in range(cfg.num_hidden_layers)}


def patch_layer(monkeypatch):
    original = layers.mla_attention

    def biased(ops, cfg, a, *args, **kwargs):
        partial, cache = original(ops, cfg, a, *args, **kwargs)
        if ops.lay.rank == 0:                                   # a = "model.layers.<L>.self_attn."
            partial = ops.add(partial, ops.weight(a + "o_proj.test_bias"))
        return partial, cache
    monkeypatch.setattr(layers, "mla_attention", biased)


def patch_oracle(monkeypatch, bias: dict):
    original = MLA.__call__

    def biased(self, x, pos, visible, cache, layer, w, naive=False):
        return original(self, x, pos, visible, cache, layer, w, naive) + bias[layer].astype(np.float64)
    monkeypatch.setattr(MLA, "__call__", biased)


def oracle_logits(target):
    P = len(PROMPT)
    return target.forward(PROMPT, np.arange(P), causal_visible(0, P), target.new_cache())[0]


def numpy_logits(engine_dir, bias=None):
    ex = EngineExecutor(engine_dir)
    if bias is not None:
        ex.ranks.ranks[0].weights.update({BIAS_NAME.format(L): b.astype(np.float64) for L, b in bias.items()})
    P = len(PROMPT)
    return ex.target_forward(PROMPT, np.arange(P), causal_visible(0, P), ex.new_target_cache())[0]


def graph_logits(engine_dir, monkeypatch, bias=None):
    if bias is not None:
        specs = onnx_runner.rank_specs
        monkeypatch.setattr(onnx_runner, "rank_specs", lambda *a, **k: {
            **specs(*a, **k), **{BIAS_NAME.format(L): TensorSpec("F32", b.shape) for L, b in bias.items()}})
    g = GraphRanks.from_engine(engine_dir, act="float64")
    if bias is not None:
        g.weights[0].update({BIAS_NAME.format(L): b for L, b in bias.items()})
    P = len(PROMPT)
    return g.target_forward(PROMPT, np.arange(P), mask_words(causal_visible(0, P)[:, :P]), g.new_target_caches(32)).logits


@pytest.mark.parametrize("tp", [1, 2])
def test_a_bias_in_the_one_layer_function_moves_numpy_and_onnx_as_it_moves_the_oracle(engine, oracles, monkeypatch,
                                                                                      tp):
    target, target32, _ = oracles("tiny")
    engine_dir = engine("tiny", tp)
    bias = biases(target.config)
    before = {"oracle": oracle_logits(target), "oracle32": oracle_logits(target32),
              "numpy": numpy_logits(engine_dir), "onnx": graph_logits(engine_dir, monkeypatch)}
    patch_layer(monkeypatch)
    patch_oracle(monkeypatch, bias)
    after = {"oracle": oracle_logits(target), "oracle32": oracle_logits(target32),
             "numpy": numpy_logits(engine_dir, bias), "onnx": graph_logits(engine_dir, monkeypatch, bias)}
    moved = {k: after[k] - before[k] for k in before}
    assert np.abs(moved["oracle"]).max() > 0.5                  # the bias matters, so a backend that missed it fails
    scale = np.abs(moved["oracle"]).max()
    np.testing.assert_allclose(moved["numpy"], moved["oracle"], rtol=0, atol=1e-9 * scale)
    np.testing.assert_allclose(moved["onnx"], moved["oracle32"], rtol=0, atol=1e-9 * scale)
