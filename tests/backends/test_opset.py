"""Every backend implements the whole op set, with the op set's signatures."""
import inspect

import numpy as np
import pytest

from ddtree.backends.cuda_backend import LAUNCHERS, CudaOps
from ddtree.backends.meter import MeterOps
from ddtree.backends.numpy_backend import NumpyOps
from ddtree.backends.onnx_backend import OnnxOps
from ddtree.description.opset import OP_NAMES, PATTERNS, REQUEST_OPS, Ops, RankLayout

LAY = RankLayout(0, 1, 0, 256, 0, 8, 0, 64)


def test_the_op_set_has_the_ops_the_layers_use():
    assert {"linear", "all_reduce_add_rms_norm", "rope", "kv_append", "mla_absorb_q", "mla_tree_attention", "mla_absorb_out",
            "moe", "draft_attention", "all_reduce", "vocab_winner", "vocab_topk", "tree_build", "accept_walk"} \
        <= set(OP_NAMES)


@pytest.mark.parametrize("backend", [NumpyOps, OnnxOps, MeterOps, CudaOps])
def test_every_backend_implements_every_op_with_its_signature(backend):
    assert not getattr(backend, "__abstractmethods__", None)
    for name in OP_NAMES:
        assert getattr(backend, name) is not getattr(Ops, name), f"{backend.__name__}.{name} is not implemented"
        want = list(inspect.signature(getattr(Ops, name)).parameters)
        assert list(inspect.signature(getattr(backend, name)).parameters) == want, f"{backend.__name__}.{name}"


def test_cuda_ops_views_and_the_missing_collectives():
    """CPU part of the cuda backend: reshape / slice are strided views (the GPU tests run them on kernels:
    tests/runtime/test_cuda_executor_gpu.py); at tp > 1 without a collective the collectives raise naming it."""
    import numpy as np

    from ddtree.backends.cuda_tensor import Tensor
    ops = object.__new__(CudaOps)
    ops.lay, ops.where, ops.collective = LAY, "test", None
    q_all = Tensor(1000, (3, 4, 48), np.dtype(np.uint16), (192, 48, 1))
    q_pe = ops.slice(q_all, 2, 32, 48)                                   # inside q_b's output
    assert (q_pe.ptr, q_pe.shape, q_pe.strides, q_pe.row_stride("t")) == (1064, (3, 4, 16), (192, 48, 1), 48)
    latent = Tensor(0, (3, 80), np.dtype(np.uint16), (80, 1))
    k_pe = ops.reshape(ops.slice(latent, 1, 64, 80), [0, 1, 16])
    assert (k_pe.ptr, k_pe.shape, k_pe.row_stride("t")) == (128, (3, 1, 16), 80)
    with pytest.raises(ValueError, match="needs a copy"):
        ops.reshape(ops.slice(latent, 1, 64, 80), [48])
    assert ops.all_gather(latent, "x").shape == (1, 3, 80)
    ops.lay = RankLayout(0, 2, 0, 128, 0, 8, 0, 32)
    with pytest.raises(NotImplementedError, match="collective="):
        ops.all_reduce(latent, "mlp")
    assert set(LAUNCHERS) == set(OP_NAMES) | set(PATTERNS) | set(REQUEST_OPS)


def test_stacked_compaction_equals_each_layer_compacted():
    """layers.compact over every layer's cache stacked [L, S, W] (the cuda executor's one launch) == each layer's
    rows moved one by one (a loop over the kept rows), and a bad path is refused naming the rows."""
    from ddtree.description import layers
    from ddtree.model.presets import get_preset
    cfg = get_preset("tiny")[0]
    W, L, S, T = cfg.kv_lora_rank + cfg.qk_rope_head_dim, 3, 24, 9
    cache = np.random.default_rng(3).normal(0, 1, (L, S, W)).astype(np.float32)
    keep = np.array([0, 2, 3, 7, -1, -1], np.int32)
    want = cache.copy()
    for layer in range(L):
        for i, src in enumerate(keep[:4]):
            want[layer, T + i] = cache[layer, T + src]
    ops = NumpyOps({}, LAY)
    feeds = {"cache_len": np.array([T], np.int32), "accepted": keep, "accepted_count": np.array([4], np.int32)}
    got = ops.call(layers.compact, cfg, True, feeds={"cache": cache.copy(), **feeds})["cache_out"]
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="increasing rows after 9"):
        ops.call(layers.compact, cfg, True, feeds={"cache": cache.copy(), **feeds,
                                                   "accepted": np.array([0, 3, 2, 7], np.int32)})
